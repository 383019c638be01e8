import os

import pytest
from cpu_report import pytest_addoption, pytest_configure  # noqa: F401 - the --cpu-report option

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def dist_run():
    """dist_run(world_size, fn, *args) -> per-rank results, on a persistent pool of gloo ranks."""
    import dist_pool

    def run(world_size, fn, *args, **kwargs):
        return dist_pool.get_pool(world_size).run(fn, *args, **kwargs)

    yield run
    dist_pool.shutdown()
