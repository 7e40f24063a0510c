"""junit.xml tells CI a failed rule (a regression) from an inconclusive one (the data could not decide)."""

from __future__ import annotations

from xml.etree import ElementTree as ET

from tokq.reports.junit import junit_xml


def test_failed_inconclusive_and_passed_rules_are_three_kinds_of_case():
    rules = [{"name": "max_kl", "threshold": 0.05, "bucket": None, "passed": False, "result": "fail",
              "rule": "max_kl 0.05: 0.21 [0.18, 0.25] fails"},
             {"name": "min_top1", "threshold": 0.9, "bucket": "4K-8K", "passed": False, "result": "inconclusive",
              "rule": "min_top1 0.9: 0.91 [0.88, 0.93] inconclusive"},
             {"name": "min_tpot_speedup", "threshold": 1.2, "bucket": None, "passed": True, "result": "pass",
              "rule": "min_tpot_speedup 1.2: 1.6 [1.5, 1.7] passes"},
             {"name": "max_ppl_ratio", "threshold": 1.1, "passed": False, "rule": "legacy: no result key"}]
    root = ET.fromstring(junit_xml("tokq gate", rules).split("\n", 1)[1])
    suite = root.find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("4", "2", "1")
    cases = suite.findall("testcase")
    assert cases[0].find("failure").get("type") == "fail" and cases[0].find("error") is None
    assert cases[1].find("error").get("type") == "inconclusive" and cases[1].find("failure") is None
    assert cases[1].get("name") == "min_top1 0.9 (4K-8K)" and "inconclusive" in cases[1].find("error").text
    assert cases[2].find("failure") is None and cases[2].find("error") is None
    assert cases[3].find("failure") is not None  # a rule without a result: passed decides
