#!/usr/bin/env bash
# On a lent GPU machine (no network): install the carried wheels and restartkit itself.
# Used by the device scripts:  source scripts/device-setup.sh
# CRIU, when carried as .dev/criu (a build of scripts/install-criu), goes where restartkit looks for it.
set -e
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
if [ -x .dev/criu/bin/criu ] && [ ! -x /opt/restartkit/criu/bin/criu ]; then
  mkdir -p /opt/restartkit && cp -a .dev/criu /opt/restartkit/criu
fi
python3 -c "import restartkit.strategies, tenacity, torch; print('restartkit ok; torch', torch.__version__, 'gpus', torch.cuda.device_count())"
if [ -x /opt/restartkit/criu/bin/criu ]; then /opt/restartkit/criu/bin/criu --version | head -1; fi
