"""A copy of a wheel without some of its files, its RECORD to match: what a device call carries has to fit in
64 MiB beside the tree, and the Mooncake wheel (46 MB) carries two programs nothing here runs.

    python benchmarks/slim_wheel.py WHEEL OUT_DIR [MEMBER ...]   # default members: Mooncake's two unused programs

    python benchmarks/slim_wheel.py .whl/mooncake_transfer_engine_non_cuda-*.whl /tmp/slim && \\
        mv /tmp/slim/mooncake_transfer_engine_non_cuda-*.whl .whl/     # 46 -> 31 MB

The copy keeps the wheel's name (pip reads its tags from it). Bad input (a missing wheel, a member it lacks) is
one line and exit 2.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

UNUSED = ("mooncake/transfer_engine_bench", "mooncake/mooncake_client")  # benchmark and CLI programs


def slim(wheel: Path, out_dir: Path, drop: tuple[str, ...]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as zi:
        missing = set(drop) - set(zi.namelist())
        if missing:
            raise ValueError(f"{wheel.name} has no {', '.join(sorted(missing))}")
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zo:
            for info in zi.infolist():
                if info.filename in drop:
                    continue
                data = zi.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    data = b"".join(line + b"\n" for line in data.splitlines()
                                    if line.split(b",")[0].decode() not in drop)
                zo.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return out


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    wheel, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    if not wheel.is_file():
        print(f"slim_wheel: no wheel at {wheel}", file=sys.stderr)
        sys.exit(2)
    try:
        out = slim(wheel, out_dir, tuple(sys.argv[3:]) or UNUSED)
    except (ValueError, zipfile.BadZipFile) as e:
        print(f"slim_wheel: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{out}: {wheel.stat().st_size / 1e6:.1f} -> {out.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
