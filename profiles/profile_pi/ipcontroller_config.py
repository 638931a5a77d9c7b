# Controller settings for the Pi cluster (see ipcluster_config.py beside this file).
c = get_config()  # noqa: F821

# Slow boards under load answer heartbeats late; do not unregister an engine that is only busy.
# A dead board is still noticed: 5 s x 12 misses = 1 minute (its nanny reports a crashed engine at once).
c.HeartMonitor.period = 5000  # ms between heartbeats
c.HeartMonitor.max_heartmonitor_misses = 12
c.IPController.registration_timeout = 300  # seconds a registering engine may take
