#!/usr/bin/env bash
# Run HERE (a machine with PyPI): download what scripts/gpu/megatron.sh installs on the GPU
# machine (Python 3.12, no registry) into .wheels/megatron (ignored by git; pass it to the device
# run as `carry: [".wheels"]`). Binary wheels for cp312 manylinux x86_64, no dependency
# resolution: only packages meshrl's megatron path imports that the GPU image may lack.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.wheels/megatron
mkdir -p "$dest"
python -m pip download -q --dest "$dest" --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform any \
  megatron-core==0.16.1 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing_extensions==4.16.0 structlog==26.1.0 grpcio==1.85.3 protobuf==7.36.2 \
  PyYAML==6.0.4 safetensors==0.8.0 packaging==26.4 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 \
  pytest-timeout==2.4.0
ls -1 "$dest"
du -sh "$dest"
