#!/usr/bin/env python3
"""Plays the kubelet over CRI (runtime.v1) for kiwi-tests tests/cri.rs.

Stubs are generated from api.proto (next to this file) with grpc_tools.protoc into
<state>/stubs, once; run-pod keeps each pod's PodSandboxConfig in <state>/pods, so
create-start can send it again, as CreateContainer requires.

    cri.py --address SOCK --state DIR wait-images IMAGE...
    cri.py --address SOCK --state DIR run-pod --name N --namespace NS --uid U \
        --handler kiwi --log-dir DIR [--cgroup-parent /PATH]       -> pod id
    cri.py --address SOCK --state DIR create-start --pod ID --name N --image IMG \
        [--env K=V]... --log REL -- ARGV...                        -> container id
    cri.py --address SOCK --state DIR stop-remove-pod ID

Every pod and container uses the node's network, PID and IPC namespaces: no CNI is
needed, and the simulator's shared machine (/dev/shm) and its host pids are shared.
Errors are printed as one line on stderr, with a non-zero exit status.
"""

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.join(HERE, "api.proto")
RPC_TIMEOUT = 60


class Fail(Exception):
    pass


def stubs(state):
    """Imports api_pb2 and api_pb2_grpc, generating them first if needed."""
    out = os.path.join(state, "stubs")
    if not os.path.exists(os.path.join(out, "api_pb2_grpc.py")):
        from grpc_tools import protoc

        os.makedirs(state, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix="stubs.", dir=state)
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                "-I" + HERE,
                "--python_out=" + tmp,
                "--grpc_python_out=" + tmp,
                PROTO,
            ]
        )
        if rc != 0:
            raise Fail("protoc failed on %s (exit %d)" % (PROTO, rc))
        try:
            os.rename(tmp, out)
        except OSError:
            if not os.path.exists(os.path.join(out, "api_pb2_grpc.py")):
                raise
    sys.path.insert(0, out)
    import api_pb2
    import api_pb2_grpc

    return api_pb2, api_pb2_grpc


def node_namespaces(pb):
    return pb.NamespaceOption(network=pb.NODE, pid=pb.NODE, ipc=pb.NODE)


def pod_path(state, pod_id):
    return os.path.join(state, "pods", pod_id + ".pb")


def cmd_wait_images(args, pb, rt, img):
    deadline = time.monotonic() + args.timeout
    missing = list(args.images)
    last = "no answer yet"
    while missing:
        try:
            r = img.ImageStatus(
                pb.ImageStatusRequest(image=pb.ImageSpec(image=missing[0])),
                timeout=RPC_TIMEOUT,
            )
            if r.image.id:
                missing.pop(0)
                continue
            last = "%s is not known to the CRI plugin" % missing[0]
        except Exception as e:  # the CRI plugin may still be starting
            last = describe(e)
        if time.monotonic() > deadline:
            raise Fail("images not ready after %ss: %s" % (args.timeout, last))
        time.sleep(0.05)


def cmd_run_pod(args, pb, rt, img):
    os.makedirs(args.log_dir, exist_ok=True)
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(
            name=args.name, namespace=args.namespace, uid=args.uid, attempt=0
        ),
        log_directory=args.log_dir,
        labels={"io.kubernetes.pod.name": args.name},
        linux=pb.LinuxPodSandboxConfig(
            cgroup_parent=args.cgroup_parent,
            security_context=pb.LinuxSandboxSecurityContext(
                namespace_options=node_namespaces(pb)
            )
        ),
    )
    r = rt.RunPodSandbox(
        pb.RunPodSandboxRequest(config=config, runtime_handler=args.handler),
        timeout=RPC_TIMEOUT,
    )
    os.makedirs(os.path.join(args.state, "pods"), exist_ok=True)
    with open(pod_path(args.state, r.pod_sandbox_id), "wb") as f:
        f.write(config.SerializeToString())
    print(r.pod_sandbox_id)


def cmd_create_start(args, pb, rt, img):
    try:
        with open(pod_path(args.state, args.pod), "rb") as f:
            sandbox = pb.PodSandboxConfig.FromString(f.read())
    except OSError as e:
        raise Fail("pod %s was not started by this state dir: %s" % (args.pod, e))
    if not args.argv:
        raise Fail("no command after --")
    envs = []
    for kv in args.env:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise Fail("--env %r is not K=V" % kv)
        # KeyValue.value is `bytes` in this api.proto (binary env values; a `string`
        # before): the same bytes on the wire either way.
        envs.append(pb.KeyValue(key=k, value=v.encode()))
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=args.name, attempt=0),
        image=pb.ImageSpec(image=args.image),
        command=args.argv,
        envs=envs,
        log_path=args.log,
        linux=pb.LinuxContainerConfig(
            security_context=pb.LinuxContainerSecurityContext(
                namespace_options=node_namespaces(pb)
            )
        ),
    )
    r = rt.CreateContainer(
        pb.CreateContainerRequest(
            pod_sandbox_id=args.pod, config=config, sandbox_config=sandbox
        ),
        timeout=RPC_TIMEOUT,
    )
    rt.StartContainer(
        pb.StartContainerRequest(container_id=r.container_id), timeout=RPC_TIMEOUT
    )
    print(r.container_id)


def cmd_stop_remove_pod(args, pb, rt, img):
    rt.StopPodSandbox(
        pb.StopPodSandboxRequest(pod_sandbox_id=args.pod), timeout=RPC_TIMEOUT
    )
    rt.RemovePodSandbox(
        pb.RemovePodSandboxRequest(pod_sandbox_id=args.pod), timeout=RPC_TIMEOUT
    )
    try:
        os.unlink(pod_path(args.state, args.pod))
    except OSError:
        pass


def describe(e):
    import grpc

    if isinstance(e, grpc.RpcError):
        return "%s: %s" % (e.code().name, (e.details() or "").replace("\n", " "))
    return str(e).replace("\n", " ")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True, help="containerd's socket")
    p.add_argument("--state", required=True, help="stub cache and pod configs")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("wait-images")
    s.add_argument("images", nargs="+")
    s.add_argument("--timeout", type=float, default=30)
    s.set_defaults(fn=cmd_wait_images)

    s = sub.add_parser("run-pod")
    s.add_argument("--name", required=True)
    s.add_argument("--namespace", required=True)
    s.add_argument("--uid", required=True)
    s.add_argument("--handler", default="")
    s.add_argument("--log-dir", required=True)
    s.add_argument("--cgroup-parent", default="", help="cgroupfs path, e.g. /test-pods")
    s.set_defaults(fn=cmd_run_pod)

    s = sub.add_parser("create-start")
    s.add_argument("--pod", required=True)
    s.add_argument("--name", required=True)
    s.add_argument("--image", required=True)
    s.add_argument("--env", action="append", default=[])
    s.add_argument("--log", required=True, help="relative to the pod's log directory")
    s.add_argument("argv", nargs="*")
    s.set_defaults(fn=cmd_create_start)

    s = sub.add_parser("stop-remove-pod")
    s.add_argument("pod")
    s.set_defaults(fn=cmd_stop_remove_pod)

    args = p.parse_args()
    try:
        import grpc

        pb, pb_grpc = stubs(args.state)
        channel = grpc.insecure_channel(
            "unix://" + os.path.abspath(args.address),
            options=[("grpc.default_authority", "localhost")],
        )
        with channel:
            rt = pb_grpc.RuntimeServiceStub(channel)
            img = pb_grpc.ImageServiceStub(channel)
            args.fn(args, pb, rt, img)
    except Fail as e:
        print("cri.py %s: %s" % (args.cmd, e), file=sys.stderr)
        sys.exit(1)
    except Exception as e:
        print("cri.py %s: %s" % (args.cmd, describe(e)), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
