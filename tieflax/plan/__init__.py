"""Will a config fit? ``tieflax plan`` compiles the real train and eval steps for a TPU pod or a GPU
server from any machine and reads the compiler's per-device memory.

- ``compile``: builds the step as training does (``tieflax.train``) on a target's abstract devices
  (``tieflax.hardware.targets``) and compiles it: ``plan_config``, ``plan_variants``, ``Plan``.
- ``buffers``: the largest temporaries, named by the JAX operation that made them (XLA's dump).
- ``peak``: what is live at the train step's peak, by origin (``tieflax plan --explain``).
- ``report``: the per-device table people read.
- ``child``: TPU plans compile in a child process (libtpu aborts on some programs).

Above train/ in the import floors: it compiles the steps train/ builds.
"""

from tieflax.plan.compile import (Plan, PlanError, StepMemory, check_dump_dir, plan_config, plan_config_file,
                                  plan_variants)
from tieflax.plan.report import MIN_HEADROOM, format_report, gib

__all__ = ["MIN_HEADROOM", "Plan", "PlanError", "StepMemory", "check_dump_dir", "format_report", "gib",
           "plan_config", "plan_config_file", "plan_variants"]
