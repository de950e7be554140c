"""The command line: a sensible chat answer, and one-line errors with a non-zero exit."""

import subprocess
import sys

import pytest

from tierserve.cli import build_parser, main


def test_generate_chat_answers_sensibly(capsys):
    code = main(["generate", "--chat", "What is the capital of France?", "--dtype", "float32",
                 "--max-tokens", "30"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "Paris" in out and "finish_reason=stop" in err


@pytest.mark.parametrize("argv,message", [
    (["generate", "hi", "--model", "/no/such/model.gguf"], "error: model not found"),
    (["generate", "hi", "--load-format", "dummy", "--model", "gpt-9"],
     "error: unknown model shape preset"),
    (["generate", "hi", "--temperature", "-1"], "error: temperature must be >= 0"),
    (["generate", "hi", "--max-num-seqs", "0"], "error: max_num_seqs must be >= 1"),
])
def test_errors_are_one_line_and_exit_non_zero(argv, message):
    proc = subprocess.run([sys.executable, "-m", "tierserve.cli", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_lists_the_commands_the_readme_documents():
    import pathlib
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    parser = build_parser()
    help_text = parser.format_help()
    for command in ("serve", "generate", "bench", "calibrate", "bill", "sim"):
        assert command in help_text and f"tierserve {command}" in readme
    gen_help = subprocess.run([sys.executable, "-m", "tierserve.cli", "generate", "--help"],
                              capture_output=True, text=True).stdout
    for flag in ("--chat", "--model", "--dtype", "--load-format", "--max-tokens", "--stop",
                 "--max-num-seqs", "--max-num-batched-tokens"):
        assert flag in gen_help and flag in readme, flag
    serve_help = subprocess.run([sys.executable, "-m", "tierserve.cli", "serve", "--help"],
                                capture_output=True, text=True).stdout
    import re
    flags = set(re.findall(r"--[a-z][a-z-]+", serve_help)) - {"--help"}
    assert {"--host", "--port", "--config", "--policy", "--deployment"} <= flags
    missing = sorted(f for f in flags if f not in readme)
    assert not missing, f"serve flags the README does not document: {missing}"
    epp_help = subprocess.run([sys.executable, "-m", "tierserve.cli", "epp", "--help"],
                              capture_output=True, text=True).stdout
    assert "tierserve epp" in readme
    own = set(re.findall(r"--[a-z][a-z-]+", epp_help)) - flags - {"--help"}
    assert {"--grpc-port", "--print-envoy-config", "--fail-open"} <= own
    missing = sorted(f for f in own if f not in readme)
    assert not missing, f"epp flags the README does not document: {missing}"
