"""The sources of the default long-document set: licence-clean text already on this machine.

Sources, in order (each used only where present):

- `cpython-stdlib`: the running interpreter's standard library sources (PSF-2.0); tests,
  site-packages and generated data tables are left out. Present on every machine, so the set
  is never empty.
- `python-doc`: the `python3.X-doc` Debian package's HTML manual for the running version
  (PSF-2.0; code examples also 0BSD), converted to plain text (Sphinx main body only).
- `linux-doc`: the `linux-doc-<version>` Debian package's kernel `Documentation/` (GPL-2.0;
  a file's own `SPDX-License-Identifier` line overrides that). Translations (duplicates of
  English pages) and the media uAPI tree (mostly tables) are left out.
- `debian-policy`: the Debian Policy Manual and companion texts (GPL-2.0-or-later; the FHS,
  the debconf spec (BSD-3-Clause) and copyright-format under their own notices, as the
  package's copyright file says).
- `gnu-standards`: the GNU Coding Standards and Information for Maintainers
  (GFDL-1.3-no-invariants-or-later).

Licences are SPDX identifiers where one exists, else `LicenseRef-<name>`.
"""

from __future__ import annotations

import platform
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

DPKG_STATUS = Path("/var/lib/dpkg/status")
DEBIAN_DOC = Path("/usr/share/doc")


@dataclass(frozen=True)
class SourceSpec:
    """Where one source's files are, which of them to consider, and under what licence.

    `patterns` are `Path.glob` patterns under `root`; `exclude` are fnmatch patterns on the
    relative posix path. `licence_rules` are (fnmatch pattern, licence) pairs, first match
    wins, else `licence`; with `spdx_licence` a `SPDX-License-Identifier:` line in a file's
    first lines overrides both. `max_documents` caps what this source contributes.
    """

    name: str
    package: str
    root: Path
    patterns: tuple[str, ...]
    licence: str
    version: str | None = None
    exclude: tuple[str, ...] = ()
    licence_rules: tuple[tuple[str, str], ...] = ()
    spdx_licence: bool = False
    max_documents: int = 40



def default_sources() -> list[SourceSpec]:
    """The source specs for this machine, in a fixed order (missing roots are reported, not fatal)."""
    versions = _dpkg_versions()
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    # The newest kernel's docs if several are installed (6.10 sorts after 6.9).
    linux_roots = sorted(
        DEBIAN_DOC.glob("linux-doc-*/Documentation"),
        key=lambda p: [int(n) for n in re.findall(r"\d+", p.parent.name)],
    )
    linux_root = linux_roots[-1] if linux_roots else DEBIAN_DOC / "linux-doc-6.1" / "Documentation"
    linux_pkg = linux_root.parent.name
    return [
        SourceSpec(
            name="cpython-stdlib",
            package="cpython",
            version=platform.python_version(),
            root=Path(sysconfig.get_paths()["stdlib"]),
            patterns=("**/*.py",),
            licence="PSF-2.0",
            # Tests are repetitive fixtures; encodings/, pydoc_data/ and the entity/stringprep
            # modules are generated tables, not prose or code a model is scored on.
            exclude=(
                "test/*",
                "*/test/*",
                "tests/*",
                "*/tests/*",
                "*/idle_test/*",
                "site-packages/*",
                "dist-packages/*",
                "*/__pycache__/*",
                "encodings/*",
                "pydoc_data/*",
                "html/entities.py",
                "stringprep.py",
                "config-*/*",
            ),
            max_documents=60,
        ),
        SourceSpec(
            name="python-doc",
            package=f"python{py}-doc",
            version=versions.get(f"python{py}-doc"),
            root=DEBIAN_DOC / f"python{py}" / "html",
            patterns=("**/*.html",),
            licence="PSF-2.0",  # code examples in it are also offered under 0BSD
            # Indexes, search, the changelog (a list of issue numbers) and licence texts.
            exclude=(
                "_sources/*",
                "_static/*",
                "_images/*",
                "_downloads/*",
                "genindex*",
                "py-modindex.html",
                "search.html",
                "contents.html",
                "whatsnew/changelog.html",
                "license.html",
                "copyright.html",
                "bugs.html",
                "about.html",
                "download.html",
            ),
        ),
        SourceSpec(
            name="linux-doc",
            package=linux_pkg,
            version=versions.get(linux_pkg),
            root=linux_root,
            patterns=("**/*.rst", "**/*.rst.gz", "**/*.txt", "**/*.txt.gz"),
            licence="GPL-2.0-only",
            exclude=("translations/*", "userspace-api/media/*", "ABI/*", "*/ABI/*"),
            spdx_licence=True,
        ),
        SourceSpec(
            name="debian-policy",
            package="debian-policy",
            version=versions.get("debian-policy"),
            root=DEBIAN_DOC / "debian-policy",
            patterns=("*.txt.gz", "fhs/*.txt.gz"),
            licence="GPL-2.0-or-later",
            licence_rules=(
                ("fhs/*", "LicenseRef-FHS"),  # copying and modified copies permitted with notice
                ("debconf_specification*", "BSD-3-Clause"),
                ("copyright-format*", "LicenseRef-preserve-notice"),
            ),
            exclude=("README*",),
            max_documents=10,
        ),
        SourceSpec(
            name="gnu-standards",
            package="gnu-standards",
            version=versions.get("gnu-standards"),
            root=DEBIAN_DOC / "gnu-standards",
            patterns=("*.text.gz",),
            licence="GFDL-1.3-no-invariants-or-later",
            max_documents=4,
        ),
    ]


def _dpkg_versions() -> dict[str, str]:
    """Installed Debian package versions, read from dpkg's status file ({} when not Debian)."""
    try:
        status = DPKG_STATUS.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    versions: dict[str, str] = {}
    for stanza in status.split("\n\n"):
        fields = dict(re.findall(r"^(Package|Version|Status): (.*)$", stanza, flags=re.M))
        if "Package" in fields and "Version" in fields and fields.get("Status", "").endswith(" installed"):
            versions[fields["Package"]] = fields["Version"]
    return versions
