#!/usr/bin/env bash
# Run by Snakemake inside envs/vllm.yaml's environment once it is created. The registry's
# torchvision, torchaudio and torchcodec are built for the CUDA torch; beside a CPU torch,
# importing vLLM fails with "operator torchvision::nms does not exist". The text path needs none.
set -euo pipefail
if python -c "import sys, torch; sys.exit('+cpu' not in torch.__version__)"; then
    pip uninstall -y torchvision torchaudio torchcodec
fi
python -c "import vllm; print('vllm', vllm.__version__)"
