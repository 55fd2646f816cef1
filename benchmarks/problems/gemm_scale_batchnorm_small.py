# The small shape of issue 5 (128 x 1024 -> 512), launch-bound; otherwise demos/problems/gemm_scale_batchnorm.py.
# Linear -> per-feature scale -> BatchNorm1d (the model runs in training mode unless .eval() is called).
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features, scale_shape, eps=1e-5, momentum=0.1):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.scale = nn.Parameter(torch.randn(scale_shape))
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum)

    def forward(self, x):
        x = self.gemm(x)
        x = x * self.scale
        x = self.bn(x)
        return x


batch_size = 128
in_features = 1024
out_features = 512
scale_shape = (out_features,)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, scale_shape]
