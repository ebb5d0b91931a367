"""The `radixmesh generate` command, as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "radixmesh.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_answers_paris():
    proc = run_cli("generate", "--prompt", "What is the capital of France?", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


@pytest.mark.parametrize("setup", ["missing", "corrupt-gguf", "unsupported-arch", "bad-backend"])
def test_bad_input_gives_one_clear_line(tmp_path, setup):
    args = ["generate", "--prompt", "hi"]
    if setup == "missing":
        args += ["--model", str(tmp_path / "nope")]
        expect = "not found"
    elif setup == "corrupt-gguf":
        bad = tmp_path / "broken.gguf"
        bad.write_bytes(b"GGUF" + b"\x00" * 20)
        args += ["--model", str(bad)]
        expect = "corrupt GGUF"
    elif setup == "unsupported-arch":
        (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
        args += ["--model", str(tmp_path)]
        expect = "unsupported architecture"
    else:
        args += ["--attention-backend", "nope"]
        expect = "unknown attention backend"
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("radixmesh: error:")]
    assert len(lines) == 1 and expect in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
