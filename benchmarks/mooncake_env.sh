# Sourced by the GPU scripts (gpu_disagg.sh, gpu_sim_profile.sh), from the repository root, with $PY set: makes
# Mooncake Store (and, with SERVE_EXTRAS=1, the serve extras) importable from what the caller carries, where the
# machine lacks them: ./.whl (mooncake_transfer_engine_non_cuda-*-cp312-*.whl; fastapi, uvicorn, ... wheels) and
# ./.deb (libibverbs1, libnl-3-200, libnl-route-3-200 .deb files, unpacked under /tmp, no root needed). Keeps all
# of Mooncake's traffic on loopback (MC_TCP_BIND_ADDRESS=127.0.0.1). A device call carries 64 MiB with the tree:
# slim the Mooncake wheel first (benchmarks/slim_wheel.py, 46 -> 31 MB).
if [[ "${SERVE_EXTRAS:-0}" == 1 ]] && ! $PY -c "import fastapi, uvicorn, prometheus_client, httpx" 2>/dev/null; then
    $PY -m pip install -q --no-index --find-links .whl fastapi uvicorn prometheus_client httpx
fi
if ! $PY -c "import mooncake.store" 2>/dev/null; then
    if compgen -G ".deb/*.deb" >/dev/null; then  # libibverbs1 and its libnl libraries
        for f in .deb/*.deb; do dpkg -x "$f" /tmp/nf-ib; done
        export LD_LIBRARY_PATH="/tmp/nf-ib/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/nf-mooncake \
        .whl/mooncake_transfer_engine_non_cuda-*.whl
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/nf-mooncake" PATH="/tmp/nf-mooncake/bin:$PATH"
    $PY -c "import mooncake.store" || { echo "Mooncake Store does not import (see above)" >&2; exit 2; }
fi
export MC_TCP_BIND_ADDRESS=127.0.0.1
