"""What a deployment's key folder holds, by name and size (imports nothing).

The bridge's keys tool (`dyadic_jax.bridge.keys`) writes and loads these,
the wire's MAC (`wire.auth`) is keyed from the secret, and the experiments'
flags check a --keys_dir against them at parse time, before anything
starts: one definition for all three.
"""

SECRET_FILE = "secret.key"   # the deployment secret, hex
SECRET_BYTES = 32            # its length, decoded
# 32 random bytes have fewer than 16 distinct values with probability
# below 1e-12: fewer means the secret was typed or patterned, not drawn.
MIN_DISTINCT_BYTES = 16
CURVE_KEY_CHARS = 40         # z85 of a 32-byte CURVE key
Z85 = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                ".-:+=^!/*?&<>()[]{}@%$#")
