"""Engine flags, generated from the config dataclasses (config.py): one flag per field,
its default the field's default, its help the field's docstring. So every engine default
and choice is stated once, and a new field is a new flag.

Flags given on the command line are remembered (`explicit(args)`): a YAML config fills
only the settings the command line did not give, even where a flag was given its default.
A boolean field is a pair of switches, as in vLLM: `--enable-prefix-caching` and
`--no-enable-prefix-caching`.
"""

import argparse
import ast
import inspect
import types
from dataclasses import MISSING, fields

from tierserve.config import (DEPLOYMENTS, DTYPES, KV_CACHE_DTYPES, LOAD_FORMATS, POLICIES,
                              QUANTIZATIONS, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig,
                              SpeculativeConfig, TierConfig, resolve_dtype)

SECTIONS = (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig),
            ("tiers", TierConfig))
CHOICES = {"dtype": DTYPES, "load_format": LOAD_FORMATS, "policy": POLICIES,
           "deployment": DEPLOYMENTS, "quantization": QUANTIZATIONS,
           "kv_cache_dtype": KV_CACHE_DTYPES}
CONVERT = {"dtype": resolve_dtype}
"""Flags whose value is rewritten on parsing, so code reading `args` (the benchmarks echo
args.dtype) sees `bfloat16` where `auto` was given."""
YAML_ONLY = {"slo"}
"""Fields with no flag (structures): set in the YAML config."""
_EXPLICIT = "_explicit_flags"


def _docstrings(cls) -> dict[str, str]:
    """Field name -> the docstring under it in the class body."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _scalar_type(annotation):
    """int, float, str or bool, from `T` or `T | None`."""
    if isinstance(annotation, types.UnionType):
        (annotation,) = [a for a in annotation.__args__ if a is not type(None)]
    return annotation


_UNSET = object()


class Remember(argparse.Action):
    """`store` (or, given a `const`, `store_const`) that also notes the setting as given
    on the command line (`explicit(args)`)."""

    def __init__(self, option_strings, dest, nargs=None, const=_UNSET, **kwargs):
        self.switch = const is not _UNSET
        super().__init__(option_strings, dest, nargs=0 if self.switch else nargs,
                         const=const if self.switch else None, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if self.switch else values)
        mark_explicit(namespace, self.dest)


class RememberSwitch(argparse.BooleanOptionalAction):
    """`--flag` / `--no-flag` (argparse's BooleanOptionalAction) that also notes the
    setting as given on the command line."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        mark_explicit(namespace, self.dest)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags, one group per config section."""
    for section, cls in SECTIONS:
        group = p.add_argument_group(section)
        docs = _docstrings(cls)
        for f in fields(cls):
            if f.name in YAML_ONLY:
                continue
            default = f.default if f.default is not MISSING else None
            kind = _scalar_type(f.type)
            help_text = docs.get(f.name, "").replace("%", "%%")
            flag = "--" + f.name.replace("_", "-")
            if kind is bool:
                group.add_argument(flag, dest=f.name, action=RememberSwitch, default=default,
                                   help=f"{help_text} (default: {'on' if default else 'off'})")
                continue
            group.add_argument(flag, dest=f.name, action=Remember,
                               type=CONVERT.get(f.name, kind),
                               default=default, choices=CHOICES.get(f.name),
                               help=help_text if default is None
                               else f"{help_text} (default: {default})")
    p.add_argument_group("speculative").add_argument(
        "--speculative-config", dest="speculative_config", action=Remember, default=None,
        metavar="JSON", help="speculative decoding by n-gram prompt lookup, as vLLM's flag: "
        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4, "
        "\"prompt_lookup_min\": 2, \"disable_by_batch_size\": 4, \"tiers\": [\"priority\"]}' "
        "(those are the defaults of the keys left out; `tiers`, which served tiers "
        "speculate, is tierserve's). Default: off")


def explicit(args) -> set[str]:
    """The settings given on the command line (flags whose action is `Remember` or
    `RememberSwitch`)."""
    return set(getattr(args, _EXPLICIT, set()))


def mark_explicit(args, name: str) -> None:
    setattr(args, _EXPLICIT, explicit(args) | {name})


def engine_config_from_args(args) -> EngineConfig:
    parts = {}
    for section, cls in SECTIONS:
        parts[section] = cls(**{f.name: getattr(args, f.name) for f in fields(cls)
                                if f.name not in YAML_ONLY and hasattr(args, f.name)})
    spec = getattr(args, "speculative_config", None)
    if spec:
        parts["speculative"] = SpeculativeConfig.parse(spec)
    return EngineConfig(**parts)

