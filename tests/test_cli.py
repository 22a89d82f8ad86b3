import subprocess
import sys

import pytest

from trl_ext import __version__
from trl_ext.cli import main


def test_version_subprocess():
    out = subprocess.run([sys.executable, "-m", "trl_ext.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"trl-ext {__version__}"


def test_quickstart_runs_and_saves_the_adapter(tmp_path, capsys):
    assert main(["quickstart", "--output-dir", str(tmp_path), "--steps", "2"]) == 0
    printed = capsys.readouterr().out
    assert "2 IPO GRPO steps" in printed
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()


def test_quickstart_rejects_bad_steps():
    with pytest.raises(SystemExit, match="--steps must be >= 1"):
        main(["quickstart", "--steps", "0"])
