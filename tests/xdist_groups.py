"""Which tests share a pytest-xdist process, chosen by module name where the run is scheduled.

pytest-xdist 3.8's `--dist loadgroup` writes a test's group into its node id, which pytest 9.2 no
longer lets a plugin change: every group was silently ignored and each test went to whichever
process was free. So each tier's conftest makes the scheduler itself
(`pytest_xdist_make_scheduler`): xdist's scope scheduling, a scope being the group a test's
module belongs to. A group's tests run in one process, in collection order, and groups are
handed out in collection order too (not xdist's default, largest test count first: a count of
tests says nothing of their seconds), which each tier's conftest sets."""

from collections.abc import Callable

from xdist.scheduler import LoadScopeScheduling


class ModuleGroups(LoadScopeScheduling):
    def __init__(self, config, log, group_of: Callable[[str], str]):
        config.option.loadscopereorder = False
        super().__init__(config, log)
        self._group_of = group_of

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return self._group_of(path.rpartition("/")[2].removesuffix(".py"))
