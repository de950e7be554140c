"""An hour-by-hour capacity schedule: what `tierserve plan --forecast` writes, what
`tierserve sim --schedule` replays, and what a server applies at the scheduled times.

The file is YAML with one top-level key, `schedule:` (so the same block can sit in a
`tierserve serve --config` file):

    schedule:
      version: 1
      start: '2026-12-07T00:00:00+00:00'  # start of entry 0 (ISO 8601; UTC unless it says)
      hour_s: 3600        # length of every entry; less compresses the day (demos, tests)
      prewarm_s: 1800     # lead time already folded into each entry's `replicas`
      hardware: h100-sxm  # what the replicas were planned on
      model: llama-3-8b
      tp: 1               # tensor-parallel devices per replica
      deployment: shared  # shared: one pool `main`; dedicated: pools `fast` and `main`
      slo:                # the targets the plan met (seconds; null: no target)
        priority: {ttft_s: 0.2, tpot_s: 0.03}
        default: {ttft_s: 2.0, tpot_s: 0.1}
      attainment: 0.9     # share of each SLO tier's requests the plan kept within both
      hours:
      - hour: 0           # entry index, consecutive from 0 (checked)
        replicas: {main: 2}        # replicas to have serving during this entry, per pool
        need: {main: 1}            # what this entry's own traffic needs (no pre-warm)
        max_num_seqs: 256
        max_num_batched_tokens: 2048
        reserved_priority_seqs: 2  # slots per replica only priority requests may take
        priority_step_time_s: 0.03 # the tiered step-time cap (null: the server's default)
        batch: true                # batch lines may run in this entry
        rate: 41.2                 # forecast interactive requests/s (for reading)
        batch_rate: 12.0           # batch lines/s the plan made room for (for reading)

Entry i covers [start + i * hour_s, start + (i + 1) * hour_s). A schedule repeats: after
its last entry it starts over from entry 0 (a 24-hour plan holds every day), and before
`start` it is read the same way backwards. `replicas` is what to have *ready*: with a
pre-warm lead the next entry's capacity is already counted in the entry before it, so an
autoscaler may simply follow `replicas`; `need` is kept to show the lead.

Plain Python (PyYAML only): the server imports it as it is.
"""

import math
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import yaml

from tierserve.errors import ConfigError
from tierserve.tiers import TIER_NAMES

VERSION = 1
POOLS = {"shared": ("main",), "dedicated": ("fast", "main")}


@dataclass(frozen=True)
class HourPlan:
    """What one entry of the schedule sets."""

    replicas: dict[str, int]
    """Pool name -> replicas to have serving (pre-warm included)."""
    need: dict[str, int]
    """Pool name -> replicas this entry's own forecast traffic needs."""
    max_num_seqs: int = 256
    """Sequence slots per replica."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step."""
    reserved_priority_seqs: int = 0
    """Slots per replica only priority requests may take."""
    priority_step_time_s: float | None = None
    """The tiered step-time cap; None: the server's own default."""
    batch: bool = True
    """Whether batch lines may run in this entry (others wait for one that allows it,
    unless their completion window would run out first)."""
    rate: float | None = None
    """Forecast interactive requests/s (informational)."""
    batch_rate: float = 0.0
    """Batch lines/s the plan made room for (informational)."""

    @property
    def total_replicas(self) -> int:
        return sum(self.replicas.values())


@dataclass
class Schedule:
    start_unix: float
    """Start of entry 0, unix seconds."""
    hours: list[HourPlan]
    hour_s: float = 3600.0
    """Length of every entry."""
    prewarm_s: float = 0.0
    hardware: str = "h100-sxm"
    model: str = "llama-3-8b"
    tp: int = 1
    """Tensor-parallel devices per replica."""
    deployment: str = "shared"
    slo: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    """tier -> (ttft_s, tpot_s) the plan met."""
    attainment: float = 0.9
    """Share of each SLO tier's requests the plan kept within both targets."""

    def validate(self) -> None:
        if not self.hours:
            raise ConfigError("schedule: no hours")
        if not self.hour_s > 0 or self.prewarm_s < 0 or self.tp < 1:
            raise ConfigError(f"schedule: need hour_s > 0, prewarm_s >= 0 and tp >= 1, got "
                              f"{self.hour_s}, {self.prewarm_s}, {self.tp}")
        if self.deployment not in POOLS:
            raise ConfigError(f"schedule: deployment must be shared or dedicated, got "
                              f"{self.deployment!r}")
        if not 0 < self.attainment <= 1:
            raise ConfigError(f"schedule: attainment must be in (0, 1], got {self.attainment}")
        bad = [t for t in self.slo if t not in TIER_NAMES]
        if bad:
            raise ConfigError(f"schedule: slo names an unknown tier {bad[0]!r}")
        for i, h in enumerate(self.hours):
            where = f"schedule: hour {i}"
            if set(h.replicas) != set(POOLS[self.deployment]) or set(h.need) != set(h.replicas):
                raise ConfigError(f"{where}: replicas and need must name the pools "
                                  f"{', '.join(POOLS[self.deployment])}")
            if any(n < 0 for n in (*h.replicas.values(), *h.need.values())):
                raise ConfigError(f"{where}: replica counts must be >= 0")
            if h.max_num_seqs < 1 or h.max_num_batched_tokens < 1:
                raise ConfigError(f"{where}: max_num_seqs and max_num_batched_tokens must "
                                  "be >= 1")
            if not 0 <= h.reserved_priority_seqs < h.max_num_seqs:
                raise ConfigError(f"{where}: reserved_priority_seqs must be in "
                                  "[0, max_num_seqs)")
            if h.priority_step_time_s is not None and h.priority_step_time_s < 0:
                raise ConfigError(f"{where}: priority_step_time_s must be >= 0")

    # ---------------------------------------------------------------- lookups
    def index_at(self, t: float) -> int:
        """The entry in force at unix time `t` (the schedule repeats)."""
        return math.floor((t - self.start_unix) / self.hour_s) % len(self.hours)

    def entry_at(self, t: float) -> HourPlan:
        return self.hours[self.index_at(t)]

    def next_change(self, t: float) -> float:
        """When the entry in force at `t` ends."""
        return self.start_unix + (math.floor((t - self.start_unix) / self.hour_s) + 1) \
            * self.hour_s

    def next_batch_start(self, t: float) -> float | None:
        """The earliest time >= `t` at which batch lines may run (`t` itself inside a
        batch entry); None if no entry allows batch."""
        if not any(h.batch for h in self.hours):
            return None
        start = t
        while not self.entry_at(start).batch:
            start = self.next_change(start)
        return start

    # ----------------------------------------------------------------- (de)serialise
    def to_dict(self) -> dict:
        start = datetime.fromtimestamp(self.start_unix, timezone.utc).isoformat()
        hours = []
        for i, h in enumerate(self.hours):
            entry = {"hour": i, **asdict(h)}
            entry["rate"] = None if h.rate is None else round(h.rate, 3)
            entry["batch_rate"] = round(h.batch_rate, 3)
            hours.append(entry)
        return {"schedule": {
            "version": VERSION, "start": start, "hour_s": self.hour_s,
            "prewarm_s": self.prewarm_s, "hardware": self.hardware, "model": self.model,
            "tp": self.tp, "deployment": self.deployment,
            "slo": {t: {"ttft_s": a, "tpot_s": b} for t, (a, b) in self.slo.items()},
            "attainment": self.attainment,
            "hours": hours}}


def parse_schedule(raw) -> Schedule:
    """A schedule from its YAML mapping: the file's whole content ({schedule: ...}) or
    the mapping under `schedule:`."""
    if isinstance(raw, dict) and "schedule" in raw:
        raw = raw["schedule"]
    if not isinstance(raw, dict):
        raise ConfigError(f"schedule: expected a mapping, got {type(raw).__name__}")
    if raw.get("version", VERSION) != VERSION:
        raise ConfigError(f"schedule: version {raw.get('version')} is not {VERSION}")
    unknown = set(raw) - {"version", "start", "hour_s", "prewarm_s", "hardware", "model",
                          "tp", "deployment", "slo", "attainment", "hours"}
    if unknown:
        raise ConfigError(f"schedule: unknown key {sorted(unknown)[0]!r}")
    try:
        hours = [_hour(entry, i) for i, entry in enumerate(raw.get("hours") or [])]
        slo = {str(t): (v.get("ttft_s"), v.get("tpot_s"))
               for t, v in (raw.get("slo") or {}).items()}
        schedule = Schedule(
            start_unix=_unix(raw.get("start")), hours=hours,
            hour_s=float(raw.get("hour_s", 3600)), prewarm_s=float(raw.get("prewarm_s", 0)),
            hardware=str(raw.get("hardware", "h100-sxm")),
            model=str(raw.get("model", "llama-3-8b")), tp=int(raw.get("tp", 1)),
            deployment=str(raw.get("deployment", "shared")), slo=slo,
            attainment=float(raw.get("attainment", 0.9)))
    except (TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"schedule: {exc}") from None
    schedule.validate()
    return schedule


def _hour(entry, i: int) -> HourPlan:
    if not isinstance(entry, dict):
        raise ValueError(f"hour {i}: expected a mapping")
    entry = dict(entry)
    if entry.pop("hour", i) != i:
        raise ValueError(f"hour {i}: entries must be in order, numbered from 0")
    unknown = set(entry) - set(HourPlan.__dataclass_fields__)
    if unknown:
        raise ValueError(f"hour {i}: unknown key {sorted(unknown)[0]!r}")
    entry["replicas"] = {str(k): int(v) for k, v in entry["replicas"].items()}
    entry["need"] = {str(k): int(v) for k, v in entry.get("need", entry["replicas"]).items()}
    for key in ("max_num_seqs", "max_num_batched_tokens", "reserved_priority_seqs"):
        if key in entry:
            entry[key] = int(entry[key])
    if "batch" in entry and not isinstance(entry["batch"], bool):
        raise ValueError(f"hour {i}: batch must be true or false")
    return HourPlan(**entry)


def _unix(value) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, datetime):  # YAML reads an unquoted timestamp as one
        dt = value
    elif isinstance(value, str):
        dt = datetime.fromisoformat(value)
    else:
        raise ValueError("start must be an ISO date-time or unix seconds")
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


def load_schedule(path: str | Path) -> Schedule:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the schedule {path}: {exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not YAML ({exc})") from None
    return parse_schedule(raw)


def save_schedule(schedule: Schedule, path: str | Path) -> None:
    schedule.validate()
    Path(path).write_text(yaml.safe_dump(schedule.to_dict(), sort_keys=False,
                                         default_flow_style=None, width=100))
