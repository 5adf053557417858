"""Test-session settings shared by every test module."""

import torch

# The equivalence tests run tiny models (hidden 32, seq 16): intra-op threads only add
# synchronization, and on a shared 2-core CI machine spinning worker threads oversubscribe the
# cores (measured: the suite ran ~4x slower with 2 threads under load). Stock and streamed runs
# share this setting, so it does not affect any comparison.
torch.set_num_threads(1)
