"""Add the sha256 of every pinned package in requirements.txt, for `pip install --require-hashes`.

    .venv/bin/llm-hash-requirements [requirements.txt]

A pin that already carries a hash keeps it; for the others, one `pip download --no-deps` fetches the files pip
would install on this platform (wheels; a wheel on local disk where pip's find-links has one, as for the CPU
torch wheel) and their hashes are written after the pins. Comments and order are kept. After changing a pin,
delete its hash and run this again; `make venv` installs nothing else."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)")


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(pins: list[str]) -> dict[str, str]:
    """{normalized name: sha256} of the wheel pip picks for each pin."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", tmp, *pins],
            check=True,
        )
        return {normalized(wheel.name.split("-")[0]): sha256(wheel) for wheel in Path(tmp).glob("*.whl")}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0] if argv else "requirements.txt")
    lines = path.read_text().splitlines()
    missing = [f"{m.group(1)}=={m.group(2)}" for m in map(PIN.match, lines) if m and "--hash=" not in m.string]
    hashes = download(missing) if missing else {}
    out = []
    for line in lines:
        match = PIN.match(line)
        if match and "--hash=" not in line:
            name = normalized(match.group(1))
            if name not in hashes:
                raise SystemExit(f"no wheel downloaded for {match.group(0)}")
            line = f"{match.group(0)} --hash=sha256:{hashes[name]}"
        out.append(line)
    path.write_text("\n".join(out) + "\n")
    print(f"{len(missing)} pin(s) hashed, {sum('--hash=' in line for line in out)} in all", file=sys.stderr)


if __name__ == "__main__":
    main()
