# torchvision.ops.MLP(1024, [4096, 4096, 256], norm_layer=nn.BatchNorm1d), batch 4096: per hidden layer
# Linear -> BatchNorm1d -> ReLU -> Dropout(0.0), then a bare Linear -> Dropout(0.0). Built here layer
# by layer as torchvision builds it, so that the problem needs no torchvision.
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, hidden_features):
        super().__init__()
        layers = []
        for width in hidden_features[:-1]:
            layers += [nn.Linear(in_features, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.0)]
            in_features = width
        layers += [nn.Linear(in_features, hidden_features[-1]), nn.Dropout(0.0)]
        self.mlp = nn.Sequential(*layers)

    def forward(self, x):
        return self.mlp(x)


batch_size = 4096
in_features = 1024
out_features = 256
hidden_features = [4 * in_features, 4 * in_features, out_features]  # follows --size and --shrink


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, hidden_features]
