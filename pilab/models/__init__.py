"""The models: the networks pilab builds by name (``zoo``: MobileNetV2, SqueezeNet, a spiking CNN, or your
own builder found by its string, ``custom``), their names and widths without torch (``names``), what a
network does for one image (``counts``) and how one starts (``init``: residual blocks as the identity, a
whitened stem). Importing this package imports none of them; each name loads its module on first use::

    from pilab.models import build_model, count_parameters
    count_parameters(build_model("mobilenetv2_cifar", width=0.5))
"""
from .. import lazy

__getattr__, __dir__, __all__ = lazy.face(__name__, {
    "zoo": ["build_model", "probe_model", "activation_elements", "largest_output_elements", "train_flops_per_image", "TAKES_TIMESTEPS"],
    "counts": ["count_parameters", "forward_macs", "counted_train_flops", "muon_weights"],
    "names": ["MODEL_NAMES", "ModelError", "WIDTH_RANGE", "check_width", "is_builder_spec", "only_named"],
    "init": ["zero_residual_bn", "whiten_stem", "sample_rows", "dirac_convs", "freeze_bn_scale"],
    "custom": ["LOCAL_BUILDERS", "check_output", "input_channels", "is_local", "model_spec", "source_file",
               "source_digest"],
    "spiking": ["synaptic_ops"],
})
