"""A prelude for the `python -c` scripts that run as if some packages were not installed: no
module found, no distribution in `importlib.metadata`. Prepend `HIDE` to a script, then call
`hide(module, dists)`: `module(name, spec)` says which found modules to hide, `dists` names the
distributions to hide."""

HIDE = '''
import importlib.abc, sys


class Hide(importlib.abc.MetaPathFinder):
    """One of sys.meta_path's finders, with the hidden modules and distributions left out."""

    def __init__(self, inner, module, dists):
        self.inner, self.module, self.dists = inner, module, dists

    def find_spec(self, name, path, target=None):
        spec = self.inner.find_spec(name, path, target)
        return None if spec is not None and self.module(name, spec) else spec

    def find_distributions(self, *args, **kwargs):
        found = getattr(self.inner, "find_distributions", lambda *a, **k: ())(*args, **kwargs)
        return (d for d in found if d.metadata["Name"].lower() not in self.dists)


def hide(module, dists):
    dists = {d.lower() for d in dists}
    sys.meta_path[:] = [Hide(f, module, dists) for f in sys.meta_path]
'''
