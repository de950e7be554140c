"""A throwaway PostgreSQL server for tests: `initdb` in a temporary folder, the server
listening on a unix socket in that folder (or on 127.0.0.1 with `tcp=True`), trust
authentication, stopped (`pg_ctl stop -m immediate`) and deleted afterwards.

The binaries come from the operating system's packages (Debian: `apt-get install
postgresql`, found under /usr/lib/postgresql/N/bin), or from TIERSERVE_PG_BINDIR. Run as
root, the server runs as the `postgres` user (PostgreSQL refuses root).

    with postgres_server() as url:      # postgresql://postgres@/tierserve?host=/tmp/...
        url2 = create_database(url)    # a fresh, empty database on the same server

pytest: `dialect` (parametrized: sqlite, postgresql), `pg_server` (one server per session,
shared by every module that imports it), `pg_database` (a fresh database per test). A
module imports the fixtures it uses: `from pg import dialect, pg_database, pg_server`.
"""

import contextlib
import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import pytest

MISSING = ("PostgreSQL server binaries (initdb, pg_ctl) not found: install the operating "
           "system's package (Debian/Ubuntu: apt-get install postgresql), or set "
           "TIERSERVE_PG_BINDIR to the folder holding them; to run only the SQLite half of "
           "the tests, deselect with -k 'not postgresql'")


def find_bindir() -> Path:
    """The folder of initdb and pg_ctl, newest version first; RuntimeError if none."""
    candidates = []
    if os.environ.get("TIERSERVE_PG_BINDIR"):
        candidates.append(os.environ["TIERSERVE_PG_BINDIR"])
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                         key=lambda p: int(Path(p).parent.name)
                         if Path(p).parent.name.isdigit() else 0, reverse=True)
    if shutil.which("pg_ctl"):
        candidates.append(os.path.dirname(shutil.which("pg_ctl")))
    for c in candidates:
        if all(os.access(os.path.join(c, b), os.X_OK) for b in ("initdb", "pg_ctl", "postgres")):
            return Path(c)
    raise RuntimeError(MISSING)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_dbname(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


@contextlib.contextmanager
def postgres_server(tcp: bool = False, dbname: str = "tierserve"):
    """Start a throwaway server; yield the URL of an empty database `dbname` on it."""
    bindir = find_bindir()
    try:
        import psycopg
    except ImportError:
        raise RuntimeError("the PostgreSQL tests need psycopg: pip install 'psycopg[binary]'")
    as_user: list[str] = []
    root = tempfile.mkdtemp(prefix="tierserve-pg-")
    if os.geteuid() == 0:  # PostgreSQL will not run as root: run it as `postgres`
        import pwd
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(root)
            raise RuntimeError("running as root, and there is no `postgres` user to run the "
                               "PostgreSQL server as (the postgresql package creates it)")
        os.chown(root, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, logfile = os.path.join(root, "data"), os.path.join(root, "server.log")
    port = _free_port() if tcp else 5432  # a unix socket's name only: no clash possible
    listen = "127.0.0.1" if tcp else "''"
    options = (f"-k {root} -p {port} -c listen_addresses={listen} -c fsync=off "
               "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")

    def run(*cmd: str) -> None:
        proc = subprocess.run([*as_user, *cmd], cwd=root, capture_output=True, text=True)
        if proc.returncode != 0:
            log = Path(logfile).read_text() if os.path.exists(logfile) else ""
            raise RuntimeError(f"{' '.join(cmd[:2])} failed ({proc.returncode}):\n"
                               f"{proc.stdout}{proc.stderr}{log}")

    started = False
    try:
        run(str(bindir / "initdb"), "-D", data, "-U", "postgres", "-A", "trust", "-E", "UTF8",
            "--locale=C", "--no-sync")
        run(str(bindir / "pg_ctl"), "-D", data, "-l", logfile, "-o", options, "-w", "-t",
            "60", "start")
        started = True
        host = "127.0.0.1" if tcp else ""
        query = "" if tcp else f"?host={quote(root, safe='')}"
        admin = f"postgresql://postgres@{host}:{port}/postgres{query}"
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{dbname}"')
        yield _with_dbname(admin, dbname)
    finally:
        if started:
            subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", data, "-m", "immediate",
                            "-w", "stop"], cwd=root, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


_counter = itertools.count()


def create_database(server_url: str, name: str | None = None) -> str:
    """A fresh, empty database on the server of `server_url`; its URL."""
    import psycopg
    name = name or f"t{os.getpid()}_{next(_counter)}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return _with_dbname(server_url, name)


# ------------------------------------------------------------------ pytest
# Every module importing `pg_server` gets its own fixture definition; they share one server
# (started by the first, stopped with the last) so a session starts PostgreSQL once.
_shared = {"users": 0, "cm": None, "url": None}
_shared_lock = threading.Lock()


@pytest.fixture(scope="session")
def pg_server():
    """The URL of a database on the session's throwaway PostgreSQL server."""
    with _shared_lock:
        if _shared["cm"] is None:
            cm = postgres_server()
            try:
                _shared["url"] = cm.__enter__()
            except RuntimeError as exc:
                pytest.fail(str(exc), pytrace=False)
            _shared["cm"] = cm
        _shared["users"] += 1
    try:
        yield _shared["url"]
    finally:
        with _shared_lock:
            _shared["users"] -= 1
            if _shared["users"] == 0:
                cm, _shared["cm"] = _shared["cm"], None
                cm.__exit__(None, None, None)


@pytest.fixture
def pg_database(pg_server):
    """The URL of a fresh, empty PostgreSQL database, for one test."""
    return create_database(pg_server)


@pytest.fixture(params=["sqlite", "postgresql"])
def dialect(request):
    """Runs a test once per database; it asks for `pg_database` only on postgresql (so a
    SQLite-only run, -k sqlite, starts no server)."""
    return request.param
