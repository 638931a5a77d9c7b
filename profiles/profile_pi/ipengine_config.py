# Engine settings for the Pi cluster (see ipcluster_config.py beside this file).
c = get_config()  # noqa: F821

# Seconds an engine waits for the controller to answer its registration; 48 engines register at once
# over 1 GbE while the head node is importing torch too.
c.IPEngine.timeout = 60
