# Sourced by scripts/gpu/*.sh on the GPU host (Python + torch + transformers, no Ray, no registry):
# `ray_site PY SITE LOG` installs the Ray Serve bundle carried in .wheels/ray
# (shared/tools/gpu-bundle.sh) into SITE unless PY can already import Ray Serve; pip's output goes to LOG.
ray_site() {
  local py=$1 site=$2 log=$3 w
  "$py" -c "import ray.serve, pydantic, structlog" 2>/dev/null && return 0
  mkdir -p "$site"
  tar -xJf .wheels/ray/ray_slim.tar.xz -C "$site"
  find "$site/ray/core/src" -type f ! -name '*.py' -exec chmod +x {} +  # the tarball drops exec bits
  for w in .wheels/ray/*.whl; do
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$w" >> "$log" 2>&1 \
      || "$py" -m zipfile -e "$w" "$site"
  done
}
