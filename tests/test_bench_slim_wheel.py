"""benchmarks/slim_wheel.py: a wheel's copy without the named members, its RECORD to match, and installable."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "slim_wheel.py"
NAME = "toy-1.0-py3-none-any.whl"


def make_wheel(path: Path) -> Path:
    files = {"toy/__init__.py": b"VALUE = 7\n", "toy/big_tool": b"\0" * 50_000,
             "toy-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: toy\nVersion: 1.0\n",
             "toy-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = b"".join(f"{n},,\n".encode() for n in files) + b"toy-1.0.dist-info/RECORD,,\n"
    wheel = path / NAME
    with zipfile.ZipFile(wheel, "w") as z:
        for n, data in {**files, "toy-1.0.dist-info/RECORD": record}.items():
            z.writestr(n, data)
    return wheel


def test_the_copy_lacks_the_members_keeps_the_rest_and_installs(tmp_path):
    wheel = make_wheel(tmp_path)
    subprocess.run([sys.executable, str(SCRIPT), str(wheel), str(tmp_path / "out"), "toy/big_tool"], check=True,
                   capture_output=True)
    out = tmp_path / "out" / NAME
    with zipfile.ZipFile(out) as z:
        assert "toy/big_tool" not in z.namelist() and "toy/__init__.py" in z.namelist()
        record = z.read("toy-1.0.dist-info/RECORD").decode()
        assert "toy/big_tool" not in record and "toy/__init__.py,," in record
    assert out.stat().st_size < wheel.stat().st_size / 10
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(tmp_path / "site"), str(out)], check=True, capture_output=True)
    done = subprocess.run([sys.executable, "-c", "import toy; print(toy.VALUE)"], capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path / "site")})
    assert done.stdout.strip() == "7"


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    wheel = make_wheel(tmp_path)
    none = tmp_path / "none.whl"
    for args, line in [([str(none), str(tmp_path)], f"slim_wheel: no wheel at {none}"),
                       ([str(wheel), str(tmp_path / "o"), "toy/absent"], f"slim_wheel: {NAME} has no toy/absent")]:
        done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [line]
