#!/usr/bin/env bash
# The Python packages the GPU machine lacks, as wheels in .whl/ at the checkout's root, to carry to it. Its image has
# torch, Lightning, torchmetrics, tokenizers, sacrebleu, tensorboard, pytest and PyYAML for Python 3.12; DeepSpeed and
# rouge-score are source distributions, built here into pure-Python wheels (DeepSpeed compiles its ops there, on use).
# sacremoses (with click and joblib) gives bench_multi30k its Moses-tokenized BLEU. transformers at setup.cfg's
# version (the image's 5.17 is older than the pretrained extra's >=5.24; its needs, huggingface_hub 1.33, tokenizers,
# safetensors, regex, typer and numpy, are there) and sentencepiece (T5's tokenizer in the tests) run the import-parity
# tests in bf16 (tests/test_gpu_pretrained.py). torchao: --model.fp8's float8 linears.
#   bash benchmarks/gpu_wheels.sh     # then, there: pip install --no-index --no-deps --target DIR .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl
mkdir .whl
pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8 rouge-score==0.1.2
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 nltk==3.10.4 defusedxml==0.7.1 \
  hjson==3.1.0 sacremoses==0.2.0 click==8.1.8 joblib==1.5.2 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 torchao==0.18.0 \
  transformers==5.24.0 sentencepiece==0.2.3
du -sh .whl
