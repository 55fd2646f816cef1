# Linear -> BatchNorm1d, nothing after it: the baseline the tail problems are timed against
# (gemm_batchnorm_swish.py has the same shapes and a four-op pointwise tail).
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.bn = nn.BatchNorm1d(out_features)

    def forward(self, x):
        return self.bn(self.gemm(x))


batch_size = 1024
in_features = 8192
out_features = 8192


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
