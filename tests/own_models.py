"""Models pilab does not define, written as a user would: builders taking ``num_classes`` (tests/test_custom.py,
tests/custom_worker.py; the strings "own_models:small_resnet" etc. name them)."""
import torch
from torch import nn


class _Block(nn.Module):
    """A ResNet basic block: two 3x3 conv + BatchNorm2d, a pooled 1x1 conv + BatchNorm2d shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            # ResNet-D's shortcut (average pool, then a 1x1 conv): torch 2.13's CPU backward of a 1x1 stride-2
            # conv in channels_last memory crashes at 64x64 inputs
            self.short = nn.Sequential(nn.AvgPool2d(stride), nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.short(x))


class SmallResNet(nn.Module):
    def __init__(self, num_classes: int, width: float = 1.0, in_channels: int = 3):
        super().__init__()
        c = max(4, int(16 * width))
        self.stem = nn.Sequential(nn.Conv2d(in_channels, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.layers = nn.Sequential(_Block(c, c, 1), _Block(c, 2 * c, 2), _Block(2 * c, 4 * c, 2))
        self.fc = nn.Linear(4 * c, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def small_resnet(num_classes, width=1.0):
    """A small ResNet (3 basic blocks, BatchNorm2d) for RGB images of any size."""
    return SmallResNet(num_classes, width)


def small_resnet_grey(num_classes):
    """The same for one-channel images (sklearn's digits)."""
    return SmallResNet(num_classes, 0.5, in_channels=1)


def bn1d_head(num_classes):
    """Convs without BatchNorm, then a classifier head with BatchNorm1d (one with momentum=None, one without
    affine parameters) and two dropout layers."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        nn.Linear(128, 64), nn.BatchNorm1d(64, momentum=None), nn.ReLU(), nn.Dropout(0.3),
        nn.Linear(64, 32), nn.BatchNorm1d(32, affine=False), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(32, num_classes))


class _HandMadeNorm(nn.Module):
    """Batch statistics computed by hand: what the simulator cannot make per-rank."""

    def forward(self, x):
        return (x - x.mean(0, keepdim=True)) / (x.std(0, keepdim=True) + 1e-5)


def hand_norm(num_classes):
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         _HandMadeNorm(), nn.Linear(8, num_classes))


def group_norm(num_classes):
    """GroupNorm and LayerNorm: per image, nothing for the simulator to do."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.LayerNorm(8), nn.Linear(8, num_classes))


def wrong_classes(num_classes):
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes + 1))


def not_a_module(num_classes):
    return "a string"


def broken_import():  # pragma: no cover - never called: the module named next to it does not exist
    import nonexistent_module_xyz  # noqa: F401
