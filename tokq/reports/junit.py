"""JUnit XML: one test case per rule, so CI systems list each threshold as a passed or failed test."""

from __future__ import annotations

from xml.etree import ElementTree as ET


def junit_xml(suite: str, rules: list[dict]) -> str:
    """`rules`: dicts with name, bucket (or None), threshold, passed, rule (the one-line reason)."""
    failures = sum(not r["passed"] for r in rules)
    root = ET.Element("testsuites", tests=str(len(rules)), failures=str(failures))
    node = ET.SubElement(root, "testsuite", name=suite, tests=str(len(rules)), failures=str(failures), errors="0")
    for r in rules:
        case = ET.SubElement(node, "testcase", classname=suite,
                             name=f"{r['name']} {r['threshold']} ({r.get('bucket') or 'overall'})")
        if not r["passed"]:
            ET.SubElement(case, "failure", message=r["rule"]).text = r["rule"]
        else:
            ET.SubElement(case, "system-out").text = r["rule"]
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
