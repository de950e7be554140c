"""`tierserve batch submit|status|results|cancel`: the batch API from the command line,
against a running server (`--base-url`, `--api-key`; or TIERSERVE_BASE_URL and
TIERSERVE_API_KEY / OPENAI_API_KEY)."""

import json
import os
import sys
import time

from tierserve.batch.store import FINAL
from tierserve.errors import TierserveError


class Client:
    def __init__(self, base_url: str, api_key: str | None, timeout_s: float = 60.0):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)

    def call(self, method: str, path: str, **kwargs):
        import httpx

        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise TierserveError(f"cannot reach {self.base_url}: {exc}") from None
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text.strip()[:200]
            raise TierserveError(f"{method} {path}: HTTP {response.status_code}: {message}")
        return response


def cmd_submit(args) -> int:
    client = _client(args)
    if not os.path.isfile(args.file):
        raise TierserveError(f"no such file: {args.file}")
    metadata = {}
    for item in args.metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise TierserveError(f"--metadata wants KEY=VALUE, got {item!r}")
        metadata[key] = value
    with open(args.file, "rb") as f:
        uploaded = client.call("POST", "/files", data={"purpose": "batch"},
                               files={"file": (os.path.basename(args.file), f)}).json()
    batch = client.call("POST", "/batches", json={
        "input_file_id": uploaded["id"], "endpoint": args.endpoint,
        "completion_window": "24h", "metadata": metadata or None}).json()
    print(batch["id"])
    if batch["status"] == "failed":
        _print_errors(batch)
        return 1
    if not args.wait:
        return 0
    return _wait(client, batch, args.poll_s)


def cmd_status(args) -> int:
    batch = _client(args).call("GET", f"/batches/{args.batch_id}").json()
    if args.format == "json":
        print(json.dumps(batch, indent=1))
        return 0
    counts, usage, cost = batch["request_counts"], batch.get("usage") or {}, batch.get("cost")
    print(f"{batch['id']}  {batch['status']}  {counts['completed']}/{counts['total']} completed,"
          f" {counts['failed']} failed  endpoint {batch['endpoint']}")
    print(f"tokens: {usage.get('input_tokens', 0)} in, {usage.get('output_tokens', 0)} out"
          + (f"; machine ${cost['machine_usd']:.6f}, charged ${cost['charge_usd']:.6f}"
             if cost else ""))
    print(f"output file: {batch['output_file_id']}  error file: {batch['error_file_id']}")
    _print_errors(batch)
    return 0


def cmd_results(args) -> int:
    client = _client(args)
    batch = client.call("GET", f"/batches/{args.batch_id}").json()
    file_id = batch["error_file_id" if args.errors else "output_file_id"]
    if batch["status"] not in FINAL:
        raise TierserveError(f"batch {args.batch_id} is {batch['status']}: results come when "
                             "it ends (tierserve batch submit --wait, or status)")
    content = client.call("GET", f"/files/{file_id}/content").content if file_id else b""
    if args.output:
        with open(args.output, "wb") as f:
            f.write(content)
        lines = content.count(b"\n")
        print(f"{lines} lines to {args.output}", file=sys.stderr)
    else:
        sys.stdout.buffer.write(content)
    return 0


def cmd_cancel(args) -> int:
    batch = _client(args).call("POST", f"/batches/{args.batch_id}/cancel").json()
    print(f"{batch['id']} {batch['status']}")
    return 0


def _wait(client: Client, batch: dict, poll_s: float) -> int:
    from tierserve.progress import Progress

    bar = Progress(f"batch {batch['id']}", batch["request_counts"]["total"])
    while batch["status"] not in FINAL:
        counts = batch["request_counts"]
        bar.update(counts["completed"] + counts["failed"], batch["status"])
        time.sleep(poll_s)
        batch = client.call("GET", f"/batches/{batch['id']}").json()
    counts = batch["request_counts"]
    bar.close(counts["completed"] + counts["failed"], batch["status"])
    print(f"{batch['status']}: {counts['completed']} completed, {counts['failed']} failed; "
          f"output file {batch['output_file_id']}, error file {batch['error_file_id']}")
    return 0 if batch["status"] == "completed" else 1


def _print_errors(batch: dict) -> None:
    for err in (batch.get("errors") or {}).get("data") or []:
        print(f"error: {err['message']}", file=sys.stderr)


def _client(args) -> Client:
    key = args.api_key or os.environ.get("TIERSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")
    return Client(args.base_url, key)


def add_parsers(sub) -> None:
    batch = sub.add_parser("batch", help="batch jobs on a running server: submit a JSONL file, "
                                         "follow it, fetch its results")
    bsub = batch.add_subparsers(dest="batch_command", required=True)

    def common(p):
        p.add_argument("--base-url", default=os.environ.get("TIERSERVE_BASE_URL",
                                                            "http://127.0.0.1:8000/v1"),
                       help="the server's API root (default: %(default)s)")
        p.add_argument("--api-key", default=None,
                       help="bearer key (default: $TIERSERVE_API_KEY or $OPENAI_API_KEY)")

    sp = bsub.add_parser("submit", help="upload FILE and start a batch; prints its id")
    sp.add_argument("file", help="JSONL: one {custom_id, method, url, body} per line")
    sp.add_argument("--endpoint", default="/v1/chat/completions",
                    choices=["/v1/chat/completions", "/v1/completions"])
    sp.add_argument("--metadata", action="append", metavar="KEY=VALUE")
    sp.add_argument("--wait", action="store_true",
                    help="follow the batch with a progress bar until it ends (exit 1 unless "
                         "it completed)")
    sp.add_argument("--poll-s", type=float, default=1.0, help="seconds between polls")
    common(sp)
    sp.set_defaults(func=cmd_submit)
    st = bsub.add_parser("status", help="a batch's status, counts, tokens and cost")
    st.add_argument("batch_id")
    st.add_argument("--format", default="table", choices=["table", "json"])
    common(st)
    st.set_defaults(func=cmd_status)
    rs = bsub.add_parser("results", help="a finished batch's output (or error) file")
    rs.add_argument("batch_id")
    rs.add_argument("--errors", action="store_true", help="the error file instead")
    rs.add_argument("-o", "--output", default=None, help="write to this file, not stdout")
    common(rs)
    rs.set_defaults(func=cmd_results)
    cn = bsub.add_parser("cancel", help="cancel a batch (running lines finish, the rest are "
                                        "not run)")
    cn.add_argument("batch_id")
    common(cn)
    cn.set_defaults(func=cmd_cancel)
