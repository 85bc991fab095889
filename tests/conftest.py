"""Test set-up: 8 CPU devices, set before JAX starts, so mesh code runs on any machine."""

import os

# Must happen before the first `import jax` anywhere in the test session.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
