"""Package discovery for the one import package `diag`, assembled from three folders.

`agent/` is `diag`, `collectors/` is `diag.collectors`, `analyzers/` is `diag.analyzers`.
Every package below those folders is found, not listed, so a new subpackage cannot be
left out of a wheel. The rest of the metadata is in pyproject.toml.
"""

from setuptools import find_packages, setup

ROOTS = {"diag": "agent", "diag.collectors": "collectors", "diag.analyzers": "analyzers"}
# Files beside the code that the code reads: the decision tree, the report's script and style.
DATA = ["*.toml", "*.js", "*.css", "*.html"]


def discovered() -> list[str]:
    out = []
    for name, folder in ROOTS.items():
        out.append(name)
        out.extend(f"{name}.{sub}" for sub in find_packages(folder))
    return sorted(out)


setup(packages=discovered(), package_dir=ROOTS, package_data={"": DATA})
