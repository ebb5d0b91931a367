#!/usr/bin/env bash
# Stage this machine's redis-server for the GPU machine (which has none): the binary in DIR/bin and the shared
# libraries `ldd` lists in DIR/lib, except the C and C++ runtimes the GPU machine has itself. gpu_suite.sh puts
# DIR (default .gpu-redis, git-ignored) on PATH and LD_LIBRARY_PATH for the stages that start Redis (services,
# serve-vs-services, pd-*). About 12 MB: with .whl (25 MB), .gpu-model (3.4 MB) and the tracked tree (19 MB) it
# stays under the 64 MiB the device carries; a NIXL wheel or a second tree (.base) on top does not fit.
#   bash scripts/gpu_redis.sh [DIR]
set -euo pipefail
dir=${1:-.gpu-redis}
server=$(command -v redis-server) || { echo "redis-server is not installed (apt-get install redis-server)" >&2; exit 1; }
rm -rf "$dir"; mkdir -p "$dir/bin" "$dir/lib"
cp "$server" "$dir/bin/"
ldd "$server" | awk '/=> \//{print $3}' | while read -r lib; do
  case $(basename "$lib") in
    libc.so.*|libm.so.*|libstdc++.so.*|libgcc_s.so.*|ld-linux*) ;;
    *) cp -L "$lib" "$dir/lib/" ;;
  esac
done
LD_LIBRARY_PATH="$dir/lib" "$dir/bin/redis-server" --version
du -sh "$dir"
