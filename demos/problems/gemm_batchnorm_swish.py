# Linear -> BatchNorm1d -> (+ bias of shape (1,)) -> (/ divide) -> x * sigmoid(x): a four-op pointwise
# tail after the batch norm (add, div, sigmoid, mul). gemm_batchnorm.py is the same chain without it.
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features, divide_value=1.0):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.bn = nn.BatchNorm1d(out_features)
        self.bias = nn.Parameter(torch.randn(1))
        self.divide_value = divide_value

    def forward(self, x):
        x = self.bn(self.gemm(x))
        x = (x + self.bias) / self.divide_value
        return x * torch.sigmoid(x)


batch_size = 1024
in_features = 8192
out_features = 8192
divide_value = 1.5


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, divide_value]
