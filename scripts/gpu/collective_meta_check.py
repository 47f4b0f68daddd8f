"""On CUDA (scripts/gpu; one GPU is enough): the collective receiver's check (`bucket_verdict`,
as `_land` runs it) on a side stream: meta_checksum agrees with the sender's host computation, and
a flipped bit in the metadata or in the bytes gives a bad verdict. The nccl tests (2 GPUs) run the
whole path."""
import torch

from services.weights.layout import FINGERPRINT_COLUMNS, fingerprint_columns_async
from services.weights.transports.collective.group import CTRL_WORDS, W_META, meta_checksum
from services.weights.transports.collective.receiver import bucket_verdict

g = torch.Generator().manual_seed(0)
meta = torch.randint(0, 256, (12345,), dtype=torch.uint8, generator=g)
host = int(meta_checksum(meta)[0])
dev = torch.device("cuda")
buf = torch.zeros(1 << 20, dtype=torch.uint8, device=dev)
nbytes = 8 * 1000
buf[:nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).to(dev)
buf[nbytes:nbytes + meta.numel()] = meta.to(dev)
ctrl = torch.zeros(CTRL_WORDS + FINGERPRINT_COLUMNS, dtype=torch.int64, device=dev)
ctrl[W_META] = host
ctrl[CTRL_WORDS:] = fingerprint_columns_async(buf, nbytes)
verify = torch.cuda.Stream()
results = []
for flip in (None, nbytes + 77, 5):
    b = buf.clone()
    if flip is not None:
        b[flip] ^= 1
    torch.cuda.synchronize()
    with torch.cuda.stream(verify):
        expected, expected_meta = ctrl[CTRL_WORDS:], ctrl[W_META:W_META + 1]
        expected.record_stream(verify)
        expected_meta.record_stream(verify)
        _, bad = bucket_verdict(b, nbytes, meta.numel(), expected, expected_meta)
    torch.cuda.synchronize()
    results.append(int(bad[0]))
print("host checksum", host, "device", int(meta_checksum(buf[nbytes:nbytes + meta.numel()])[0]))
print("verdicts (clean, meta flipped, data flipped):", results)
assert results == [0, 1, 1] and host == int(meta_checksum(buf[nbytes:nbytes + meta.numel()])[0])
print("OK", torch.__version__, torch.cuda.get_device_name(0))
