"""Package discovery for the one import package `diag`, assembled from three folders.

`agent/` is `diag`, `collectors/` is `diag.collectors`, `analyzers/` is `diag.analyzers`,
`dashboards/` is `diag.dashboards` (the Grafana dashboards and alert rules, as data).
Every package below those folders is found, not listed, so a new subpackage cannot be
left out of a wheel. The rest of the metadata is in pyproject.toml.
"""

from setuptools import Extension, find_packages, setup

ROOTS = {"diag": "agent", "diag.collectors": "collectors", "diag.analyzers": "analyzers",
         "diag.dashboards": "dashboards"}
# Files beside the code that the code reads: the decision tree, the report's script and style,
# and the Grafana dashboards, provisioning files and alert rules `diag dashboards` writes out.
DATA = ["*.toml", "*.js", "*.css", "*.html", "*.json", "*.yml", "*.md", "provisioning/*/*.yml"]


def discovered() -> list[str]:
    out = []
    for name, folder in ROOTS.items():
        out.append(name)
        out.extend(f"{name}.{sub}" for sub in find_packages(folder))
    return sorted(out)


# The compiled decoder of trace chunks (diag.analyzers.trace.scan). Optional: where it cannot be
# built (no compiler, no Python headers) the install goes on, and traces decode in Python,
# with the same results, more slowly.
KINETO_SCAN = Extension("diag.analyzers.trace._kineto_scan", ["analyzers/trace/_kineto_scan.c"],
                        extra_compile_args=["-O2"], optional=True)

setup(packages=discovered(), package_dir=ROOTS, package_data={"": DATA}, ext_modules=[KINETO_SCAN])
