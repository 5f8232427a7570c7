#!/usr/bin/env python3
"""Render, lint and validate the Kiwi Helm chart, and keep the plain manifests in
step with it.

Uses Helm's own Go engine (the `helm-python-sdk` wheel bundles it as a library, so
no `helm` binary is needed) and the Kubernetes OpenAPI schemas shipped by
`kubernetes-validate`. Both come from PyPI: see .ci/pip-packages.

    chart.py write                 render deploy/manifests/kiwi.yaml from the chart
    chart.py check                 fail if the committed manifests differ from the
                                   chart, if `helm lint` finds anything, or if any
                                   rendered or example object fails schema validation
    chart.py render [--set K=V]    print the rendered objects as a JSON list

Exit status: 0 ok, 1 check failed, 3 a required Python package is missing.
"""

import argparse
import difflib
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEPLOY = os.path.dirname(HERE)
CHART = os.path.join(DEPLOY, "helm", "kiwi")
MANIFEST = os.path.join(DEPLOY, "manifests", "kiwi.yaml")
KUSTOMIZATION = os.path.join(DEPLOY, "kustomization.yaml")
EXAMPLES = os.path.join(DEPLOY, "examples")

RELEASE = "kiwi"
NAMESPACE = "kiwi-system"
# The values the plain manifests are rendered with (`kubectl apply -k deploy/`).
PLAIN_VALUES = {"createNamespace": True}
# Kubernetes versions the objects are validated against (oldest supported, newest).
KUBE_VERSIONS = ["1.29.0", "1.37.0"]
KIND_ORDER = ["Namespace", "ConfigMap", "RuntimeClass", "DaemonSet"]

try:
    import helm_python as helm
    import kubernetes_validate
    import yaml
except ImportError as e:  # pragma: no cover - depends on the machine
    print(
        f"chart.py: missing Python package ({e.name}): pip install -r .ci/pip-packages",
        file=sys.stderr,
    )
    sys.exit(3)


def render(values):
    """The chart rendered as `helm template` would: [(source, text)], install order."""
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for source, text in files.items():
        if source.endswith("NOTES.txt") or not text.strip():
            continue
        for part in text.split("\n---\n"):
            if part.strip():
                obj = yaml.safe_load(part)
                docs.append((source, part.strip("\n") + "\n", obj))

    def key(d):
        kind = d[2]["kind"]
        rank = KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)
        return (rank, d[0], d[2]["metadata"]["name"])

    docs.sort(key=key)
    return docs


def plain_manifest_text():
    header = (
        "# GENERATED from deploy/helm/kiwi by `python3 deploy/tools/chart.py write`;\n"
        "# do not edit. Apply with `kubectl apply -k deploy/`.\n"
    )
    parts = [f"---\n# Source: {src}\n{text}" for src, text, _ in render(PLAIN_VALUES)]
    return header + "".join(parts)


def lint_errors(values):
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    found = [m for m in report.get("messages") or [] if m.get("severity", 0) >= 2]
    found += [{"error": e} for e in report.get("errors") or []]
    return found


# Custom resources of the Prometheus Operator, rendered only when asked for
# (prometheusRule.enabled, podMonitor.enabled). kubernetes-validate ships the
# built-in API's schemas only and raises SchemaNotFoundError for these, so their
# schema validation is skipped (and only theirs): their apiVersion is checked here,
# and the rules themselves by promtool (tests/tests/dashboard.rs).
CRD_KINDS = {
    "PrometheusRule": "monitoring.coreos.com/v1",
    "PodMonitor": "monitoring.coreos.com/v1",
}


def validate(obj, where):
    errors = []
    if obj.get("kind") in CRD_KINDS:
        if obj.get("apiVersion") != CRD_KINDS[obj["kind"]]:
            errors.append(f"{where}: {obj['kind']} must be {CRD_KINDS[obj['kind']]}, not {obj.get('apiVersion')}")
        if not obj.get("metadata", {}).get("name") or not isinstance(obj.get("spec"), dict):
            errors.append(f"{where}: {obj['kind']} without metadata.name or spec")
        return errors
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(str(p) for p in e.path)
            errors.append(f"{where}: {obj.get('kind')} {version}: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(f"{where}: no schema for {obj.get('kind')} in {version}: {e}")
    return errors


# Value sets the chart must render validly with, besides the defaults.
VARIANTS = [
    PLAIN_VALUES,
    {
        "scheduler": "off",
        "tq": 2.5,
        "vgpusPerGpu": 4,
        "resourceName": "example.com/vgpu",
        "metrics": {"enabled": False},
        "installer": {"restartContainerd": True, "dropIn": True, "setAsDefault": True, "cdi": True},
        "devicePlugin": {"runtimeClassName": ""},
        "imagePullSecrets": [{"name": "regcred"}],
        "spillDir": "/var/lib/kiwi/spill",
        "spillBudgetMiB": 65536,
    },
    {"installer": {"enabled": False}, "devicePlugin": {"enabled": False}, "runtimeClass": {"create": False}},
    # The monitoring objects (docs/install.md, "Dashboard and alerts").
    {
        "dashboard": {"enabled": True, "namespace": "monitoring", "annotations": {"grafana_folder": "Kiwi"}},
        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "podMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    },
]


def init_scripts(values):
    for _, _, obj in render(values):
        if obj["kind"] != "DaemonSet":
            continue
        for c in obj["spec"]["template"]["spec"].get("initContainers") or []:
            if c.get("command") == ["/bin/sh", "-c"]:
                yield f"{obj['metadata']['name']}/{c['name']}", c["args"][0]


def check_scripts():
    """`sh -n` and shellcheck on every shell script the chart renders."""
    problems = []
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        msg = "shellcheck is not installed (apt-get install shellcheck; see .ci/apt-packages)"
        if os.environ.get("CI") == "true":
            problems.append(msg)
        else:
            print(f"chart.py: SKIPPED shellcheck: {msg}", file=sys.stderr)
    for values in [{}] + VARIANTS:
        for where, script in init_scripts(values):
            tools = [["sh", "-n"]] + ([[shellcheck, "-s", "sh", "-"]] if shellcheck else [])
            for tool in tools:
                r = subprocess.run(tool, input=script, capture_output=True, text=True)
                if r.returncode != 0:
                    problems.append(
                        f"{tool[0]} on {where} with {json.dumps(values)}:\n{r.stdout}{r.stderr}"
                    )
    return problems


def check():
    problems = []
    expected = plain_manifest_text()
    try:
        with open(MANIFEST) as f:
            committed = f.read()
    except FileNotFoundError:
        committed = ""
    if committed != expected:
        diff = "".join(
            difflib.unified_diff(
                committed.splitlines(True), expected.splitlines(True), MANIFEST, "helm template"
            )
        )
        problems.append(
            f"{MANIFEST} differs from the chart; run `python3 deploy/tools/chart.py write`:\n{diff}"
        )

    for values in [{}] + VARIANTS:
        for m in lint_errors(values):
            problems.append(f"helm lint {json.dumps(values)}: {m}")
        for src, _, obj in render(values):
            problems += validate(obj, f"{src} with {json.dumps(values)}")

    problems += check_scripts()

    with open(KUSTOMIZATION) as f:
        kust = yaml.safe_load(f)
    for res in kust.get("resources", []):
        if not os.path.exists(os.path.join(DEPLOY, res)):
            problems.append(f"{KUSTOMIZATION}: resource {res} does not exist")
    if "manifests/kiwi.yaml" not in kust.get("resources", []):
        problems.append(f"{KUSTOMIZATION} must list manifests/kiwi.yaml")

    for name in sorted(os.listdir(EXAMPLES)):
        if name.endswith(".yaml"):
            with open(os.path.join(EXAMPLES, name)) as f:
                for obj in yaml.safe_load_all(f):
                    if obj:
                        problems += validate(obj, f"examples/{name}")

    # Values helm must refuse.
    for bad in [{"scheduler": "maybe"}, {"tq": 0}, {"vgpusPerGpu": 0}, {"deviceListStrategy": "x"}]:
        try:
            render(bad)
            problems.append(f"chart accepted bad values {json.dumps(bad)}")
        except helm.HelmError:
            pass

    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        return 1
    print(f"chart.py check: manifests up to date; lint clean; {len(VARIANTS) + 1} value sets valid for Kubernetes {', '.join(KUBE_VERSIONS)}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("write")
    sub.add_parser("check")
    r = sub.add_parser("render")
    r.add_argument("--set", action="append", default=[], help="helm --set syntax")
    r.add_argument("--plain", action="store_true", help="start from the plain manifests' values")
    args = ap.parse_args()

    if args.cmd == "write":
        os.makedirs(os.path.dirname(MANIFEST), exist_ok=True)
        with open(MANIFEST, "w") as f:
            f.write(plain_manifest_text())
        print(f"wrote {MANIFEST}")
        return 0
    if args.cmd == "check":
        return check()
    values = dict(PLAIN_VALUES) if args.plain else {}
    for s in args.set:
        values = merge(values, helm.parse_set_string(s))
    try:
        docs = render(values)
    except helm.HelmError as e:
        print(f"chart.py: {e}", file=sys.stderr)
        return 1
    json.dump([{"source": s, "object": o} for s, _, o in docs], sys.stdout, indent=1)
    print()
    return 0


def merge(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


if __name__ == "__main__":
    sys.exit(main())
