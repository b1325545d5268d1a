# issue 23's image-prefill row (qwen3-vl-30b-a3b shape, 8 layers, both engines) into $OUT/vl
source device_runs/setup.sh
python3 -c "import PIL, transformers; print('PIL', PIL.__version__, 'transformers', transformers.__version__)"
timeout 560 python3 benchmarks/serving_decode.py --models qwen3-vl-30b-a3b --layers 8 --timeout 270 --out-dir $OUT/vl 2>&1 | tail -25 | tee $OUT/logs/serving_decode_vl.log
