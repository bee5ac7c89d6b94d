import os

from hypothesis import HealthCheck, settings

# "ci" (the default, what `make test` runs): the same examples on every run (derandomize: drawn
# from a hash of each test), so a red run is a change, never an unlucky draw. "thorough": fresh
# random draws, many more of them; run it before a release or after touching a tested module
# (a failure prints the example to pin with @example).
settings.register_profile(
    "ci", deadline=None, max_examples=40, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", deadline=None, max_examples=500, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
