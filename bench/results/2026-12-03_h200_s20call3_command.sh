# The kept-copies CUDA test three times (command of the twentieth session's call 3; its output in bench/RESULTS.md)
export PYTHONPATH=$PWD; for i in 1 2 3; do timeout -k 5 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_offload_params_cuda.py -k "kept_on_the_gpu or left_on_the_gpu" 2>&1 | grep -v "tiered: param\|WARNING" | tail -8 | cut -c1-300; done
