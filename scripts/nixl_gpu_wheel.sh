#!/usr/bin/env bash
# Puts a trimmed NIXL wheel into .whl/ (git-ignored) for a GPU machine without network, which installs what
# .whl holds (scripts/gpu_suite.sh). The wheel as published is 56 MB (237 MB unpacked); the carried tree is
# limited to 64 MiB. Kept: the nixl package, its core libraries, the UCX plugin, UCX's own modules and the
# shared libraries those need (found with readelf). Dropped: nixl_ep (expert-parallel kernels built for three
# torch versions), the other plugins (object stores, GDS, libfabric, ...) and what only they need, headers and
# example programs. RECORD is rewritten for what is left.
#   scripts/nixl_gpu_wheel.sh                      nixl-cu13 1.5.1 for CPython 3.12 (the GPU machine)
#   PY_VERSION=311 scripts/nixl_gpu_wheel.sh       for another CPython (3.11 here, to try it on this machine)
#   NIXL_PACKAGE=nixl-cu12 NIXL_VERSION=1.5.1 ...  another build
set -euo pipefail
cd "$(dirname "$0")/.."
package=${NIXL_PACKAGE:-nixl-cu13}
version=${NIXL_VERSION:-1.5.1}
pyver=${PY_VERSION:-312}
python=${PYTHON:-python3}
command -v readelf >/dev/null || { echo "nixl_gpu_wheel: needs readelf (binutils)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$pyver" \
  --abi "cp$pyver" --platform manylinux_2_28_x86_64 "$package==$version" -d "$tmp/in"
mkdir -p .whl
rm -f .whl/"${package//-/_}"-*.whl
"$python" - "$tmp/in"/*.whl .whl <<'EOF'
import base64, hashlib, os, re, subprocess, sys, tempfile, zipfile
from pathlib import Path

src, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
work = Path(tempfile.mkdtemp())
with zipfile.ZipFile(src) as zf:
    zf.extractall(work)
mod = next(p.name for p in work.iterdir() if p.is_dir() and re.fullmatch(r"nixl_cu\d+", p.name))
mesonpy, libs = work / f".{mod}.mesonpy.libs", work / f"{mod}.libs"

def needed(path: Path) -> list[str]:
    text = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", text)

by_name = {p.name: p for d in (mesonpy, libs, libs / "nixl", libs / "ucx") if d.is_dir() for p in d.iterdir()
           if p.is_file() and ".so" in p.name}
roots = [*(work / mod).glob("*.so"), *mesonpy.glob("plugins/libplugin_UCX.so"), *libs.glob("nixl/libplugin_UCX.so"),
         *(p for p in libs.glob("ucx/libu*.so*") if "perftest" not in p.name)]
keep, todo = set(), list(roots)
while todo:
    lib = todo.pop()
    if lib in keep:
        continue
    keep.add(lib)
    todo += [by_name[n] for n in needed(lib) if n in by_name]
dropped = 0
for path in sorted(work.rglob("*")):
    rel = path.relative_to(work).as_posix()
    drop = (rel.startswith(f"nixl_ep_") or "/headers/" in rel or "/scripts/" in rel or rel.startswith(f"{mod}.scripts/")
            or (path.is_file() and ".so" in path.name and path.parent != work / mod and path not in keep))
    if drop and path.is_file():
        dropped += path.stat().st_size
        path.unlink()
for path in sorted(work.rglob("*"), reverse=True):  # empty directories
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()
dist_info = next(work.glob("*.dist-info"))
record = dist_info / "RECORD"
rows = []
for path in sorted(p for p in work.rglob("*") if p.is_file() and p != record):
    data = path.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    rows.append(f"{path.relative_to(work).as_posix()},sha256={digest},{len(data)}")
rows.append(f"{record.relative_to(work).as_posix()},,")
record.write_text("\n".join(rows) + "\n")
target = out_dir / src.name
with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zf:
    for path in sorted(p for p in work.rglob("*") if p.is_file()):
        zf.write(path, path.relative_to(work).as_posix())
kept = sum(p.stat().st_size for p in work.rglob("*") if p.is_file())
print(f"{target}: {target.stat().st_size / 2**20:.1f} MiB ({kept / 2**20:.0f} MiB unpacked; "
      f"{dropped / 2**20:.0f} MiB dropped from {src.stat().st_size / 2**20:.1f} MiB)")
EOF
