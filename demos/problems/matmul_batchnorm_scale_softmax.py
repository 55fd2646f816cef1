# A cluster-assignment layer: rows of an N-D input (flattened) times a (in, out) weight Parameter ->
# BatchNorm1d -> scalar scale -> Softmax over the clusters. The same shapes and steps as
# gemm_batchnorm_scale_softmax.py, with a matmul head instead of nn.Linear (and no bias).
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features, scale_shape=(1,)):
        super().__init__()
        self.in_features = in_features
        self.clusters = nn.Parameter(torch.randn(in_features, out_features) / in_features**0.5)
        self.bn = nn.BatchNorm1d(out_features)
        self.scale = nn.Parameter(torch.ones(scale_shape))

    def forward(self, x):
        x = x.view(-1, self.in_features) @ self.clusters
        x = self.bn(x)
        return torch.softmax(self.scale * x, dim=1)


batch_size = 1024
in_features = 8192
out_features = 8192
scale_shape = (1,)


def get_inputs():
    return [torch.rand(batch_size // 4, 4, in_features)]


def get_init_inputs():
    return [in_features, out_features, scale_shape]
