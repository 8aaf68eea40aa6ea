#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes the Debian copyright file (machine-readable, DEP-5) of scripts/deb.sh.

usage: deb_copyright.py TEMPLATE PACKAGE_RESOLVED CHECKOUTS OUT_COPYRIGHT [NOTICE_DIR]

TEMPLATE (packaging/copyright.in) holds the paragraphs written by hand: udp-fanout's own files,
the Swift runtime, and the standalone license paragraphs. The line `@DEPENDENCIES@` is replaced
by one Files paragraph per package of Package.resolved, statically linked into the programs:
its version, URL, a copyright line (its NOTICE.txt, else its LICENSE, else its first source
header) and its license, recognized from the checkout's license file. A license that is neither
Apache-2.0 nor MIT stops the build: someone has to read it and add its paragraph. With
NOTICE_DIR, each package's NOTICE.txt (and license files bundled inside it) are copied there as
<package>.NOTICE.txt / <package>.<path>.txt, as Apache-2.0 section 4(d) asks.
"""
import json
import os
import re
import shutil
import sys


def first_match(paths, pattern):
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if re.search(pattern, line) and "[yyyy]" not in line:
                        return line.strip().lstrip("/#* ").strip()
        except OSError:
            pass
    return None


def license_of(text):
    if re.search(r"Apache License\s+Version 2\.0", text):
        return "Apache-2.0"
    if "Permission is hereby granted, free of charge" in text:
        return "MIT"
    return None


# Packages of Package.resolved that are not linked into the programs: Yams, which only the tests
# use (it reads the k8s/ manifests there; the programs read YAML with Debian's libyaml-0-2, a
# Depends:), and swift-docc-plugin with its swift-docc-symbolkit, a command plugin that make docs
# runs (no target depends on it).
NOT_LINKED = {"yams", "swift-docc-plugin", "swift-docc-symbolkit"}


def main():
    template, resolved, checkouts, out = sys.argv[1:5]
    notice_dir = sys.argv[5] if len(sys.argv) > 5 else None
    pins = json.load(open(resolved))["pins"]
    paragraphs = []
    for pin in sorted(pins, key=lambda p: p["identity"]):
        # Test-only dependencies and build plugins are not in the programs.
        if pin["identity"] in NOT_LINKED:
            continue
        url = pin["location"]
        name = os.path.basename(url.rstrip("/"))
        if name.endswith(".git"):
            name = name[:-4]
        root = os.path.join(checkouts, name)
        license_files = sorted(
            os.path.join(root, f) for f in os.listdir(root)
            if re.match(r"(LICEN[CS]E|COPYING)", f, re.I)) if os.path.isdir(root) else []
        if not license_files:
            sys.exit("deb_copyright: no license file in %s (is the package resolved and checked out?)" % root)
        kind = license_of(open(license_files[0], encoding="utf-8", errors="replace").read())
        if kind is None:
            sys.exit("deb_copyright: the license of %s (%s) is neither Apache-2.0 nor MIT: "
                     "read it and add it to packaging/copyright.in" % (name, license_files[0]))
        notice = os.path.join(root, "NOTICE.txt")
        holder = first_match([notice], r"^\s*Copyright") or first_match(license_files, r"^\s*Copyright")
        if holder is None:
            sources = []
            for base, dirs, files in os.walk(os.path.join(root, "Sources")):
                dirs.sort()
                sources += [os.path.join(base, f) for f in sorted(files) if f.endswith(".swift")]
            holder = first_match(sources[:50], r"Copyright \(c\)")
        holder = re.sub(r"^Copyright\s*(\(c\)|\u00a9)?\s*", "", holder or "", flags=re.I) or "the %s authors" % name
        version = pin["state"].get("version") or pin["state"].get("revision", "")[:12]
        paragraphs.append(
            "Files: .build/checkouts/%s/*\nCopyright: %s\nLicense: %s\nComment: %s %s (%s)"
            % (name, holder, kind, pin["identity"], version, url))
        if notice_dir:
            os.makedirs(notice_dir, exist_ok=True)
            if os.path.exists(notice):
                shutil.copyfile(notice, os.path.join(notice_dir, "%s.NOTICE.txt" % pin["identity"]))
            # License files of code bundled inside a package (e.g. llhttp in swift-nio).
            for base, dirs, files in os.walk(os.path.join(root, "Sources")):
                dirs.sort()
                for f in sorted(files):
                    if re.match(r"(LICEN[CS]E|COPYING)", f, re.I):
                        rel = os.path.relpath(os.path.join(base, f), root).replace("/", ".")
                        shutil.copyfile(os.path.join(base, f),
                                        os.path.join(notice_dir, "%s.%s.txt" % (pin["identity"], rel)))
    text = open(template).read()
    if "@DEPENDENCIES@\n" not in text:
        sys.exit("deb_copyright: %s has no @DEPENDENCIES@ line" % template)
    text = text.replace("@DEPENDENCIES@\n", "\n\n".join(paragraphs) + "\n")
    with open(out, "w") as f:
        f.write(text)


main()
