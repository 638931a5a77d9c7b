"""SqueezeNet 1.1 as in torchvision, with a stride-1 stem so 32x32 inputs survive (``squeezenet1_1`` in
``pilab.models.zoo``).

    from pilab.models.squeezenet import SqueezeNet11
    model = SqueezeNet11(num_classes=10)
"""
from __future__ import annotations

import torch
from torch import nn


class Fire(nn.Module):
    """Squeeze 1x1, then expand with 1x1 and 3x3 in parallel, concatenated on channels."""

    def __init__(self, inplanes: int, squeeze: int, expand1x1: int, expand3x3: int):
        super().__init__()
        self.squeeze = nn.Conv2d(inplanes, squeeze, kernel_size=1)
        self.squeeze_activation = nn.ReLU(inplace=True)
        self.expand1x1 = nn.Conv2d(squeeze, expand1x1, kernel_size=1)
        self.expand1x1_activation = nn.ReLU(inplace=True)
        self.expand3x3 = nn.Conv2d(squeeze, expand3x3, kernel_size=3, padding=1)
        self.expand3x3_activation = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.squeeze_activation(self.squeeze(x))
        return torch.cat([self.expand1x1_activation(self.expand1x1(x)),
                          self.expand3x3_activation(self.expand3x3(x))], 1)


class SqueezeNet11(nn.Module):
    """SqueezeNet 1.1 as in torchvision, adapted to 32x32 inputs.

    The one difference from torchvision's ``squeezenet1_1``: the stem conv ``features.0`` is 3x3
    **stride 1, padding 1** (torchvision: stride 2, padding 0). Its weight shape is unchanged
    (64, 3, 3, 3), so keys, shapes and parameter count (1,235,496 at 1000 classes) match torchvision.
    The three 3x3/2 ceil-mode max-pools are kept, so a 32x32 input goes 32 -> 16 -> 8 -> 4 before
    the classifier (Dropout 0.5, 1x1 conv to classes, ReLU, global average pool), as torchvision has
    it -- including the ReLU on the logits. Initialisation as torchvision: kaiming_uniform for convs,
    normal(0, 0.01) for the final conv, zero biases.
    """

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5, in_channels: int = 3):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1),  # torchvision: stride 2, no padding
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),
            Fire(64, 16, 64, 64),
            Fire(128, 16, 64, 64),
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),
            Fire(128, 32, 128, 128),
            Fire(256, 32, 128, 128),
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),
            Fire(256, 48, 192, 192),
            Fire(384, 48, 192, 192),
            Fire(384, 64, 256, 256),
            Fire(512, 64, 256, 256),
        )
        final_conv = nn.Conv2d(512, num_classes, kernel_size=1)
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), final_conv, nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d((1, 1)))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                if m is final_conv:
                    nn.init.normal_(m.weight, mean=0.0, std=0.01)
                else:
                    nn.init.kaiming_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.classifier(self.features(x)), 1)
