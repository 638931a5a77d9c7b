# Controller settings for the Pi cluster (see ipcluster_config.py beside this file).
c = get_config()  # noqa: F821

# Slow boards under load answer heartbeats late; do not unregister an engine that is only busy.
# A dead board is still noticed: 5 s x 12 misses = 1 minute (its nanny reports a crashed engine at once).
c.HeartMonitor.period = 5000  # ms between heartbeats
c.HeartMonitor.max_heartmonitor_misses = 12
c.IPController.registration_timeout = 300  # seconds a registering engine may take

# Cells, results and the engines' output cross the cluster's network: CurveZMQ encrypts them and the
# connection files (0600, in the profile's security/) carry the controller's public key, which engines
# and clients need to talk to it. ipyparallel would drop its HMAC message signing under CurveZMQ (an
# empty Session.key); a key of our own keeps it, so a peer that learned the public key still cannot
# send a message the controller accepts. Both keys are new for every controller.
import secrets  # noqa: E402

c.Session.key = secrets.token_hex(32).encode("ascii")
c.IPController.enable_curve = True
