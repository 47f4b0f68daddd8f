#!/usr/bin/env bash
# Run HERE (a machine with PyPI): download the pure-Python / cp312 wheels that the trainer's GPU
# tests import and the GPU image (Python 3.12, torch + transformers preinstalled, no registry) may
# lack, into .wheels/trainer (git-ignored). Pass it to the device run with `carry: [".wheels"]`.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.wheels/trainer
mkdir -p "$dest"
python -m pip download -q --dest "$dest" --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform any \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing_extensions==4.16.0 structlog==26.1.0 grpcio==1.85.3 protobuf==7.36.2 PyYAML==6.0.4 \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pytest-timeout==2.4.0
ls -1 "$dest"
du -sh "$dest"
