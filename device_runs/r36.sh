# the K-major layout test compiled, then r35 (quantized decode table)
source device_runs/setup.sh
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/serving/test_serving_kernel_dispatch.py -k "kernel_layout" 2>&1 | tail -1
bash device_runs/r35_quantized_decode.sh
