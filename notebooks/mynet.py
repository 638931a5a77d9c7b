"""The model notebook 06 studies: yours would go here. A builder takes ``num_classes`` (and ``width``, if you
want pilab's --width to reach it) and returns any torch.nn.Module; pilab finds it as "mynet:resnet8"."""
from torch import nn


def resnet8(num_classes, width=1.0):
    """A small ResNet-like network: BatchNorm2d after every conv, a dropout before the classifier."""
    c = max(4, int(16 * width))

    def block(cin, cout, stride):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

    return nn.Sequential(block(3, c, 1), block(c, c, 1), block(c, 2 * c, 2), block(2 * c, 4 * c, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.1), nn.Linear(4 * c, num_classes))
