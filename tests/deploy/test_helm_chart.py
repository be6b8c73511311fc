"""The Helm chart, rendered by Helm's own engine (helm-python-sdk) and checked against the Kubernetes
schemas (kubernetes-validate, strict), the chart's values schema and the local launcher's model repository."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

# Imported, not importorskip'd: the chart tests must fail, never vanish, when the binding is broken.
import helm_python  # noqa: E402
from helm_python import Chart  # noqa: E402

from specdec.decoding.generation_config import SAMPLING_KEYS  # noqa: E402
from specdec.gateway.response_store import DEFAULT_MB as RESPONSES_STORE_MB  # noqa: E402
from specdec.serving import launcher, repository  # noqa: E402
from specdec.serving.pairs import REPO_ROOT, PairSpec  # noqa: E402
from specdec.serving.repository import render  # noqa: E402

CHART = REPO_ROOT / "helm" / "specdec-triton"
# The newest Kubernetes the validator knows and the oldest the chart supports (Chart.yaml kubeVersion).
K8S_VERSIONS = (kubernetes_validate.latest_version(), "1.25.0")
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "ScaledObject", "PrometheusRule"}  # not in the Kubernetes schemas

COMBINATIONS = {
    "defaults": {},
    "new-claim": {"models": {"source": "newClaim", "newClaim": {"size": "50Gi", "storageClassName": "fast"}}},
    "init-container": {"models": {"source": "initContainer"}},
    "autoscaling-hpa": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6}},
    "autoscaling-keda": {"keda": {"enabled": True}},
    "monitoring": {"monitoring": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True},
                                  "grafanaDashboard": {"enabled": True}},
                   "ingress": {"enabled": True, "className": "nginx",
                               "grpc": {"enabled": True, "tls": [{"hosts": ["grpc.specdec.example.com"],
                                                                  "secretName": "grpc-tls"}]},
                               "tls": [{"hosts": ["specdec.example.com"], "secretName": "tls"}]}},
    "cpu-only-ngram": {"gpu": {"count": 0}, "models": {"draft": {"method": "ngram"}, "dtype": "float32"},
                       "resources": {"requests": {"cpu": "2", "memory": "4Gi"}}, "executor": {"torchThreads": 2},
                       "speculation": {"orchestratorInstances": 1}},
    "cpu-only-defaults": {"gpu": {"count": 0}, "models": {"dtype": "float32"}},
    "content-parts": {"models": {"chatTemplateContentFormat": "openai"}},
    "cpu-bfloat16-static": {"gpu": {"count": 0}, "models": {"dtype": "bfloat16"}, "executor": {"kind": "static"}},
    "cpu-only-suffix": {"gpu": {"count": 0}, "models": {"draft": {"method": "suffix"}, "dtype": "float32"},
                        "speculation": {"suffixCacheTokens": 262144}},
    "openai-mutual-tls": {"openai": {"tls": {"secretName": "openai-tls", "clientCertificates": "required"}},
                          "monitoring": {"serviceMonitor": {"enabled": True}}, "ingress": {"enabled": True}},
    "eagle-head": {"models": {"draft": {"method": "head", "path": "/models/eagle3-head"}}},
    "eagle-head-in-target": {"models": {"draft": {"method": "head", "path": "/models/eagle3-head", "inTarget": True}}},
    "lora-adapters": {"models": {"loraAdapters": [{"name": "sql", "path": "/models/lora/sql"},
                                                  {"name": "chat-v2", "path": "/models/lora/chat"}],
                                 "loraDirectory": "/models/lora/library", "maxLoras": 6, "maxLoraRank": 32,
                                 # a layer-skip draft model runs them too
                                 "draft": {"method": "model", "loraLayers": "first"}}},
    "skip-draft": {"models": {"draft": {"method": "skip", "skipLayers": "3,5-7"}}},
    "compile-cache-claim": {"compileCache": {"source": "existingClaim", "existingClaim": {"name": "specdec-kernels"}}},
    "spread-target": {"gpu": {"count": 4, "spreadTarget": True, "draftGpu": 3, "mps": True},
                      "executor": {"prefillGraphRows": 0},
                      "speculation": {"defaultNumDraftTokens": 6, "maxContextTokens": 4096},
                      "podDisruptionBudget": {"enabled": False}, "server": {"modelRepositoryApi": {"restricted": False}}},
}


def deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def render_chart(values: dict) -> list[dict]:
    chart = Chart.load(CHART)
    try:
        files = chart.render(values, name="llm", namespace="serving")
    finally:
        chart.close()
    docs = []
    for path, text in files.items():
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def deployment(docs):
    (dep,) = by_kind(docs, "Deployment")
    return dep


def chart_values(overrides: dict) -> dict:
    return deep_merge(yaml.safe_load((CHART / "values.yaml").read_text()), overrides)


def test_helm_lint_is_clean():
    result = helm_python.lint(str(CHART))
    assert result["errors"] == [] and result["messages"] == [], result


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_every_manifest_is_valid_kubernetes(name):
    docs = render_chart(COMBINATIONS[name])
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap"} <= kinds
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] in ("monitoring.coreos.com/v1", "keda.sh/v1alpha1")
            needed = {"ScaledObject": "scaleTargetRef", "PrometheusRule": "groups"}.get(doc["kind"], "selector")
            assert doc["spec"][needed]
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_pod_is_hardened_and_probed(name):
    pod = deployment(render_chart(COMBINATIONS[name]))["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    for container in pod["containers"] + pod.get("initContainers", []):
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        assert sc["readOnlyRootFilesystem"] is True
    (triton,) = pod["containers"]
    assert triton["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    # The launcher's liveness: Triton's, and no model down past the heal timeout (its watchdog).
    assert triton["livenessProbe"]["httpGet"] == {"path": "/live", "port": "health"}
    assert launcher.parse_args(triton["args"]).heal_timeout == 300
    # The launcher's readiness endpoint (ready and not draining), on the port its HEALTH_PORT names.
    assert triton["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "health"}
    ports = {port["name"]: port["containerPort"] for port in triton["ports"]}
    env = {var["name"]: var.get("value") for var in triton["env"]}
    assert {name: str(ports[name]) for name in ("http", "grpc", "metrics", "health")} == {
        "http": env["HTTP_PORT"], "grpc": env["GRPC_PORT"], "metrics": env["METRICS_PORT"], "health": env["HEALTH_PORT"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in triton["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert "emptyDir" in volumes[mounts["/tmp"]]  # writable, with /dev/shm and the compile cache
    assert {m["name"] for m in triton["volumeMounts"] if not m.get("readOnly")} == {"shm", "tmp", "compile-cache"}


def test_gpu_limits_and_cpu_only():
    gpu = deployment(render_chart({}))["spec"]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "--mps" not in gpu["args"]
    # gpu.mps: the launcher's flag, before the `--` that ends the launcher's own arguments
    args = deployment(render_chart({"gpu": {"mps": True}}))["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args.index("--mps") < args.index("--")
    assert launcher.parse_args(args[:args.index("--")]).mps
    cpu = deployment(render_chart(COMBINATIONS["cpu-only-ngram"]))["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in cpu["env"]


def test_compiled_kernels_are_cached_on_a_volume():
    """TORCHINDUCTOR_CACHE_DIR lies in the compile-cache volume: the pod's emptyDir by default (it outlives
    a container restart), or a claim every new pod finds the kernels on."""
    for name, kind in (("defaults", "emptyDir"), ("compile-cache-claim", "persistentVolumeClaim")):
        pod = deployment(render_chart(COMBINATIONS[name]))["spec"]["template"]["spec"]
        (triton,) = pod["containers"]
        env = {var["name"]: var.get("value") for var in triton["env"]}
        (mount,) = [m["mountPath"] for m in triton["volumeMounts"] if m["name"] == "compile-cache"]
        assert mount == "/var/cache/specdec" and env["TORCHINDUCTOR_CACHE_DIR"] == "/var/cache/specdec/inductor"
        assert env["TRITON_CACHE_DIR"] == "/var/cache/specdec/triton"
        volume = {v["name"]: v for v in pod["volumes"]}["compile-cache"]
        assert kind in volume, volume
    assert volume["persistentVolumeClaim"]["claimName"] == "specdec-kernels"


def test_weights_sources():
    def pod(name):
        return deployment(render_chart(COMBINATIONS[name]))["spec"]["template"]["spec"]

    existing = pod("defaults")
    assert "initContainers" not in existing
    assert {v["name"]: v for v in existing["volumes"]}["models"]["persistentVolumeClaim"]["claimName"] == "model-weights"
    new = render_chart(COMBINATIONS["new-claim"])
    (pvc,) = by_kind(new, "PersistentVolumeClaim")
    assert pvc["spec"]["storageClassName"] == "fast" and pvc["spec"]["resources"]["requests"]["storage"] == "50Gi"
    new_pod = deployment(new)["spec"]["template"]["spec"]
    assert new_pod["initContainers"][0]["name"] == "fetch-models"
    assert {v["name"]: v for v in new_pod["volumes"]}["models"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    init = pod("init-container")
    assert init["initContainers"] and {v["name"]: v for v in init["volumes"]}["models"]["emptyDir"]["sizeLimit"]


def test_the_weights_fetch_installs_nothing_and_is_keyed_by_the_repositories():
    """The init container runs the server's own image (no pip install at pod start: air-gapped clusters),
    its fetch module takes the repositories from the values, and the token comes from a named Secret."""
    values = {"models": {"source": "newClaim", "fetch": {"targetRepo": "org/target@v2", "draftRepo": "org/draft",
                                                           "hfTokenSecret": {"name": "hf", "key": "token"}}}}
    pod = deployment(render_chart(values))["spec"]["template"]["spec"]
    (fetch,) = pod["initContainers"]
    (triton,) = pod["containers"]
    assert fetch["image"] == triton["image"] and fetch["command"] == ["python", "-m", "specdec.serving.fetch"]
    assert "pip" not in " ".join(fetch["command"] + fetch.get("args", []))
    env = {e["name"]: e for e in fetch["env"]}
    assert env["TARGET_REPO"]["value"] == "org/target@v2" and env["DRAFT_REPO"]["value"] == "org/draft"
    assert env["MODELS_DIR"]["value"] == "/models"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    for method in ("ngram", "suffix"):  # built in: no draft model to fetch
        values = {"models": {"source": "newClaim", "draft": {"method": method}}}
        (fetch,) = deployment(render_chart(values))["spec"]["template"]["spec"]["initContainers"]
        assert {e["name"]: e.get("value") for e in fetch["env"]}["DRAFT_REPO"] == "", method


def test_a_speculator_alone_fetches_its_verifier_and_anything_else_needs_a_target_repository():
    """targetRepo "" with a draft head in the speculators layout: the fetch finds its verifier (fetch.py);
    without one, rendering fails naming the value."""
    head = {"method": "head"}
    values = {"models": {"source": "newClaim", "draft": head,
                         "fetch": {"targetRepo": "", "draftRepo": "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3"}}}
    (fetch,) = deployment(render_chart(values))["spec"]["template"]["spec"]["initContainers"]
    env = {e["name"]: e.get("value") for e in fetch["env"]}
    assert env["TARGET_REPO"] == "" and env["DRAFT_REPO"] == "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3"
    for draft, repo in (({"method": "model"}, "org/draft"), (head, "")):
        values = {"models": {"source": "newClaim", "draft": draft, "fetch": {"targetRepo": "", "draftRepo": repo}}}
        with pytest.raises(helm_python.HelmError, match="models.fetch.targetRepo is empty"):
            render_chart(values)


def test_autoscaling_and_monitoring_objects():
    docs = render_chart(COMBINATIONS["autoscaling-hpa"])
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "specdec_scaling_signal"
    assert "replicas" not in deployment(docs)["spec"]  # the HPA owns the replica count
    # One recorded signal for both autoscalers: Triton's queue ratio or the orchestrator's own backlog
    # (requests waiting for a generation slot, which Triton's queue time cannot see), per pod.
    (rule,) = by_kind(docs, "PrometheusRule")
    (recorded,) = rule["spec"]["groups"][0]["rules"]
    assert recorded["record"] == "specdec:scaling_signal"
    for series in ("nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us",
                   "specdec_queued_requests", "specdec_max_live_sequences"):
        assert series in recorded["expr"], series
    keda_docs = render_chart(COMBINATIONS["autoscaling-keda"])
    (scaled,) = by_kind(keda_docs, "ScaledObject")
    assert len(by_kind(keda_docs, "PrometheusRule")) == 1
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["metadata"]["query"].startswith("avg(specdec:scaling_signal{")
    assert trigger["metricType"] == "Value"  # the release's average, not divided again by the replica count
    assert not by_kind(render_chart({}), "PrometheusRule")
    mon = render_chart(COMBINATIONS["monitoring"])
    # Triton's metrics, the launcher's (the watchdog's restarts and time down) and the OpenAI API's own.
    scraped = ["metrics", "health", "openai"]
    assert [e["port"] for e in by_kind(mon, "ServiceMonitor")[0]["spec"]["endpoints"]] == scraped
    assert [e["port"] for e in by_kind(mon, "PodMonitor")[0]["spec"]["podMetricsEndpoints"]] == scraped
    service_ports = {p["name"] for p in by_kind(mon, "Service")[0]["spec"]["ports"]}
    assert set(scraped) <= service_ports
    without_api = render_chart({**COMBINATIONS["monitoring"], "openai": {"enabled": False}})
    assert [e["port"] for e in by_kind(without_api, "ServiceMonitor")[0]["spec"]["endpoints"]] == scraped[:2]
    dashboard = [d for d in by_kind(mon, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")][0]
    panels = yaml.safe_load(dashboard["data"]["specdec-triton.json"])["panels"]
    titles = " ".join(p["title"] for p in panels).lower()
    for needed in ("acceptance", "time to first token", "tokens/s", "queue"):
        assert needed in titles
    exprs = " ".join(target["expr"] for panel in panels for target in panel["targets"])
    assert "specdec_queue_time_seconds_bucket" in exprs  # the orchestrator's own waits, beside Triton's
    assert "specdec_openai_requests_total" in exprs and "specdec_openai_time_to_first_token_seconds" in exprs
    assert "specdec_inter_token_latency_seconds_bucket" in exprs and "specdec_request_prefill_seconds_sum" in exprs
    ingresses = by_kind(mon, "Ingress")
    assert len(ingresses) == 2 and ingresses[1]["metadata"]["annotations"][
        "nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"
    # Each host gets its own certificate: the gRPC Ingress does not reuse the HTTP host's TLS entry.
    assert ingresses[1]["spec"]["tls"] == [{"hosts": ["grpc.specdec.example.com"], "secretName": "grpc-tls"}]
    plain = render_chart({"ingress": {"enabled": True, "grpc": {"enabled": True, "withoutTls": True}}})
    assert "tls" not in by_kind(plain, "Ingress")[1]["spec"]
    (pdb,) = by_kind(render_chart({}), "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1


def test_helm_test_hook_sends_a_real_request():
    (test_pod,) = [d for d in render_chart({}) if d["kind"] == "Pod"]
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = test_pod["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "client"] and "--require-output" in container["args"]
    assert "--url=http://llm-specdec-triton:8000" in container["args"]
    # The Service must not route to the test pod.
    assert "app.kubernetes.io/name" not in test_pod["metadata"]["labels"]


@pytest.mark.parametrize("bad, field", [
    ({"models": {"dtype": "int4"}}, "/models/dtype"),
    ({"models": {"draft": {"method": "eagle"}}}, "/models/draft/method"),
    ({"models": {"target": {"path": "relative/dir"}}}, "/models/target/path"),
    ({"gpu": {"count": -1}}, "/gpu/count"),
    ({"speculation": {"maxNumDraftTokens": "many"}}, "/speculation/maxNumDraftTokens"),
    ({"executor": {"fuseKernels": "yes"}}, "/executor/fuseKernels"),
    ({"executor": {"fuseMlp": "yes"}}, "/executor/fuseMlp"),
    ({"executor": {"kind": "eager"}}, "/executor/kind"),
    ({"executor": {"torchThreads": 0}}, "/executor/torchThreads"),
    ({"speculation": {"orchestratorInstances": 0}}, "/speculation/orchestratorInstances"),
    ({"executor": {"torchThreads": "many"}}, "/executor/torchThreads"),
    ({"service": {"type": "Headless"}}, "/service/type"),
    ({"unknownKey": True}, "unknownKey"),
    ({"autoscaling": {"enabled": True}, "keda": {"enabled": True}}, "allOf"),
    ({"keda": {"enabled": True, "minReplicas": 0}}, "/keda/minReplicas"),
    ({"ingress": {"enabled": True, "grpc": {"enabled": True}}}, "ingress.grpc.tls"),
    ({"speculation": {"defaultNumDraftTokens": 20, "maxNumDraftTokens": 16}}, "defaultNumDraftTokens"),
    ({"gpu": {"count": 1, "draftGpu": 1}}, "gpu.draftGpu"),
    ({"gpu": {"count": 1, "spreadTarget": True}}, "spreadTarget"),
    ({"gpu": {"count": 0, "mps": True}}, "gpu.mps needs a GPU"),
    ({"executor": {"prefillGraphRows": -1}}, "/executor/prefillGraphRows"),
    ({"gpu": {"mps": "yes"}}, "/gpu/mps"),
    ({"compileCache": {"source": "hostPath"}}, "/compileCache/source"),
    ({"compileCache": {"source": "existingClaim"}}, "/compileCache/existingClaim/name"),
    ({"openai": {"allowRuntimeLoraUpdating": True}}, "openai.allowRuntimeLoraUpdating needs models.loraClaim"),
    ({"openai": {"allowRuntimeLoraUpdating": "yes"}}, "/openai/allowRuntimeLoraUpdating"),
    ({"models": {"fetch": {"loraRepos": [{"name": "../x", "repo": "org/x"}]}}}, "/models/fetch/loraRepos/0/name"),
    ({"models": {"source": "initContainer", "fetch": {"loraRepos": [{"name": "sql", "repo": "org/x"}]},
                 "loraAdapters": [{"name": "sql", "path": "/models/sql"}]}}, "\"sql\" is named twice"),
    ({"models": {"source": "existingClaim", "existingClaim": {"name": "weights"},
                 "fetch": {"loraRepos": [{"name": "sql", "repo": "org/x"}]}}}, "models.fetch.loraRepos are fetched"),
])
def test_bad_values_are_rejected(bad, field):
    with pytest.raises(helm_python.HelmError, match=re.escape(field)):
        render_chart(bad)


def normalized(config: str) -> list[str]:
    """Config text without comments, one normalized line per statement line."""
    lines = (re.sub(r"\s+", " ", line.split("#", 1)[0]).strip() for line in config.splitlines())
    return [line for line in lines if line]


def pair_for(values: dict) -> PairSpec:
    """The PairSpec the local launcher would serve for the chart's settings."""
    models, gpu, spec = values["models"], values["gpu"], values["speculation"]
    method, in_target = models["draft"]["method"], models["draft"].get("inTarget", False)
    return PairSpec(
        name="chart", target_path=models["target"]["path"],
        tokenizer_path=models["target"]["tokenizerPath"] or models["target"]["path"],
        draft_paths={"draft_model": models["draft"]["path"]} if method == "model" else {},
        draft_heads={"draft_model": models["draft"]["path"]} if method == "head" and not in_target else {},
        hosted_heads={"draft_model": models["draft"]["path"]} if method == "head" and in_target else {},
        skip_drafts={"draft_model": models["draft"]["skipLayers"]} if method == "skip" else {},
        default_draft="" if method in ("model", "head", "skip") else method, dtype=models["dtype"],
        max_context_tokens=spec["maxContextTokens"], apply_chat_template=models["applyChatTemplate"],
        device="gpu" if gpu["count"] > 0 else "cpu", target_gpu=gpu["targetGpu"], spread_target=gpu["spreadTarget"],
        draft_gpu=gpu["draftGpu"], adaptive_draft=spec["adaptiveDraft"],
        default_num_draft_tokens=spec["defaultNumDraftTokens"],
        max_num_draft_tokens=spec["maxNumDraftTokens"], default_max_tokens=spec["defaultMaxTokens"],
        max_max_tokens=spec["maxMaxTokens"], max_sequences=spec["maxSequences"],
        max_live_sequences=spec["maxLiveSequences"], when_full=spec["whenFull"],
        orchestrator_instances=spec["orchestratorInstances"],
        sequence_idle_timeout_s=spec["sequenceIdleTimeoutSeconds"], compile=values["executor"]["compile"],
        executor=values["executor"]["kind"],
        fuse_kernels=values["executor"]["fuseKernels"], fuse_mlp=values["executor"]["fuseMlp"],
        attention=values["executor"]["attention"], run_ahead=values["executor"]["runAhead"],
        prefill_graph_rows=values["executor"]["prefillGraphRows"],
        torch_threads=str(values["executor"]["torchThreads"]),
        kv_memory_fraction_target=values["executor"]["kvMemoryFraction"]["target"],
        kv_memory_fraction_draft=values["executor"]["kvMemoryFraction"]["draft"],
        prefix_caching=values["executor"]["prefixCaching"]["enabled"],
        prefix_cache_tokens=values["executor"]["prefixCaching"]["tokens"],
        lora_adapters={adapter["name"]: adapter["path"] for adapter in models["loraAdapters"]},
        lora_directory=models["loraDirectory"], max_loras=models["maxLoras"], max_lora_rank=models["maxLoraRank"],
        chat_template=models["chatTemplate"], trust_request_chat_template=models["trustRequestChatTemplate"],
        chat_template_content_format=models["chatTemplateContentFormat"],
        generation_config="" if models["generationConfig"] in ("auto", "vllm") else models["generationConfig"],
        draft_lora_layers={"draft_model": models["draft"]["loraLayers"]}
        if method == "model" and models["draft"]["loraLayers"] else {})


@pytest.mark.parametrize("name, orchestrators", [("defaults", 1), ("cpu-only-ngram", 1), ("cpu-only-defaults", 2),
                                                 ("cpu-only-suffix", 2), ("spread-target", 1), ("eagle-head", 1),
                                                 ("eagle-head-in-target", 1), ("skip-draft", 1), ("lora-adapters", 1)])
def test_model_configuration_matches_the_launcher(name, orchestrators, tmp_path):
    docs = render_chart(COMBINATIONS[name])
    (configs,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-model-config")]
    repo = render(pair_for(chart_values(COMBINATIONS[name])), tmp_path / "repo")
    rendered = {d.name: (d / "config.pbtxt").read_text() for d in repo.iterdir() if d.name != "ensemble"}
    assert {key.removesuffix(".config.pbtxt") for key in configs["data"]} == set(rendered)
    for model, text in rendered.items():
        assert normalized(configs["data"][f"{model}.config.pbtxt"]) == normalized(text), model
    # Orchestrator processes: one with GPUs, two on a CPU-only pod, unless set.
    assert f"instance_group [ {{ count: {orchestrators}, kind: KIND_CPU }} ]" in rendered["speculative_decoding"]

    # The server loads exactly the rendered models; the launcher accepts the container's arguments.
    triton = deployment(docs)["spec"]["template"]["spec"]["containers"][0]
    args = launcher.parse_args(triton["args"])
    assert args.model_repository == "/opt/specdec/model_repository"
    loaded = {a.split("=", 1)[1] for a in args.server_args if a.startswith("--load-model=")}
    assert loaded == {d.name for d in repo.iterdir()}
    assert "--model-control-mode=explicit" in args.server_args
    mounted = {Path(m["mountPath"]).parent.name for m in triton["volumeMounts"] if m["name"] == "model-config"}
    assert mounted == set(rendered)


def test_one_default_context_length_for_chart_launcher_and_image():
    """The chart, the launcher (and so compose and the image) and the committed model configuration agree."""
    from specdec import tensor_names as tn

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["speculation"]["maxContextTokens"] == tn.DEFAULT_MAX_CONTEXT_TOKENS
    assert launcher.parse_args(["--target", "/m"]).max_context_tokens == tn.DEFAULT_MAX_CONTEXT_TOKENS
    committed = (REPO_ROOT / "model_repository" / "speculative_decoding" / "config.pbtxt").read_text()
    assert f'key: "max_context_tokens", value: {{ string_value: "{tn.DEFAULT_MAX_CONTEXT_TOKENS}" }}' in committed


def test_one_max_logits_tokens_for_chart_and_committed_configuration_and_the_value_reaches_the_orchestrator():
    from specdec import tensor_names as tn

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["speculation"]["maxLogitsTokens"] == tn.DEFAULT_MAX_LOGITS_TOKENS
    committed = (REPO_ROOT / "model_repository" / "speculative_decoding" / "config.pbtxt").read_text()
    assert f'key: "max_logits_tokens", value: {{ string_value: "{tn.DEFAULT_MAX_LOGITS_TOKENS}" }}' in committed
    configs = [doc for doc in render_chart({"speculation": {"maxLogitsTokens": 64}})
               if doc.get("kind") == "ConfigMap"]
    assert any('key: "max_logits_tokens", value: { string_value: "64" }' in text
               for doc in configs for text in (doc.get("data") or {}).values())


def test_one_default_for_prompts_in_cuda_graphs_in_chart_launcher_and_configs():
    """prefill_graph_rows: the chart, the launcher's pair and both committed model configurations agree."""
    from specdec import tensor_names as tn

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["executor"]["prefillGraphRows"] == tn.DEFAULT_PREFILL_GRAPH_ROWS
    assert PairSpec("p", "/m", "/m").prefill_graph_rows == tn.DEFAULT_PREFILL_GRAPH_ROWS
    for model in ("target_model", "draft_model"):
        committed = (REPO_ROOT / "model_repository" / model / "config.pbtxt").read_text()
        assert f'key: "prefill_graph_rows", value: {{ string_value: "{tn.DEFAULT_PREFILL_GRAPH_ROWS}" }}' in committed


def test_one_default_orchestrator_instance_count_for_chart_launcher_and_image():
    from specdec import tensor_names as tn

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    # Unset everywhere: the count follows the models' device (the chart's gpu.count; the chart's renders
    # are compared with the launcher's for GPU and CPU-only values in the parity test below).
    assert values["speculation"]["orchestratorInstances"] is None
    assert launcher.parse_args(["--target", "/m"]).orchestrator_instances is None
    for device in ("cpu", "gpu"):
        pair = PairSpec("p", "/m", "/m", device=device)
        assert repository.orchestrator_instances(pair) == tn.DEFAULT_ORCHESTRATOR_INSTANCES[device]
    assert repository.orchestrator_instances(PairSpec("p", "/m", "/m", device="gpu", orchestrator_instances=3)) == 3
    assert tn.DEFAULT_ORCHESTRATOR_INSTANCES == {"cpu": 2, "gpu": 1}  # the measured choice (docs/design.md)
    committed = (REPO_ROOT / "model_repository" / "speculative_decoding" / "config.pbtxt").read_text()
    assert f"instance_group [ {{ count: {tn.DEFAULT_ORCHESTRATOR_INSTANCES['cpu']}, kind: KIND_CPU }} ]" in committed


@pytest.mark.parametrize("load_timeout, period", [(1200, 10), (95, 10), (600, 7)])
def test_one_value_drives_the_launchers_load_timeout_and_the_startup_probe(load_timeout, period):
    """The launcher gives up loading after server.loadTimeoutSeconds; the startup probe allows at least that
    long (and at most one probe period more), so neither kills a slow load the other still waits for."""
    docs = render_chart({"server": {"loadTimeoutSeconds": load_timeout, "launcherArgs": ["--run-dir=/tmp/run"]},
                         "probes": {"startup": {"periodSeconds": period}}})
    (triton,) = deployment(docs)["spec"]["template"]["spec"]["containers"]
    args = launcher.parse_args(triton["args"])
    assert args.ready_timeout == load_timeout
    assert args.run_dir == "/tmp/run"  # launcher flags reach the launcher, not tritonserver
    probe = triton["startupProbe"]
    allowed = probe["periodSeconds"] * probe["failureThreshold"]
    assert load_timeout < allowed <= load_timeout + 2 * period, (allowed, load_timeout)


def test_rollouts_cannot_deadlock_on_a_single_node_claim():
    """A ReadWriteOnce-only new claim: Recreate (a surge pod on another node would never mount it), and no
    second replica at all; a shared claim keeps the surge-one rollout; updateStrategy overrides."""
    rwo = {"models": {"source": "newClaim", "newClaim": {"accessModes": ["ReadWriteOnce"]}}}
    assert deployment(render_chart(rwo))["spec"]["strategy"] == {"type": "Recreate"}
    rox = {"models": {"source": "newClaim", "newClaim": {"accessModes": ["ReadOnlyMany"]}}, "replicaCount": 2}
    assert deployment(render_chart(rox))["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert deployment(render_chart({}))["spec"]["strategy"]["type"] == "RollingUpdate"  # an existing claim
    chosen = {"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}}
    assert deployment(render_chart(chosen))["spec"]["strategy"] == chosen["updateStrategy"]
    for more in ({"replicaCount": 2}, {"autoscaling": {"enabled": True}}):
        with pytest.raises(helm_python.HelmError, match="ReadWriteOnce"):
            render_chart({**rwo, **more})


def test_one_value_drives_the_drain_the_grace_period_and_the_exit():
    """SIGTERM on rollout: preStop lets the endpoints drop the pod, the launcher drains for drainSeconds
    (readiness, through the healthcheck, is already down), then Triton exits; the grace period covers all."""
    docs = render_chart({"server": {"drainSeconds": 300}})
    pod = deployment(docs)["spec"]["template"]["spec"]
    (triton,) = pod["containers"]
    args = launcher.parse_args(triton["args"])
    assert args.drain_timeout == 300
    exit_timeout = int(next(a for a in args.server_args if a.startswith("--exit-timeout-secs=")).split("=")[1])
    pre_stop = int(triton["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + args.drain_timeout + exit_timeout


def test_the_openai_api_has_a_port_a_service_port_an_ingress_path_and_a_key_from_a_secret():
    docs = render_chart({"ingress": {"enabled": True}, "openai": {"servedModelNames": ["llama-3.1-8b", "llama"],
                                                                   "apiKeySecret": "openai-key",
                                                                   "toolCallParser": "llama3_json",
                                                                   "reasoningParser": "qwen3",
                                                                   "responsesStoreMB": 64}})
    triton = deployment(docs)["spec"]["template"]["spec"]["containers"][0]
    ports = {port["name"]: port["containerPort"] for port in triton["ports"]}
    env = {var["name"]: var for var in triton["env"]}
    assert str(ports["openai"]) == env["OPENAI_PORT"]["value"] == "9000"
    assert env["SPECDEC_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "openai-key", "key": "api-key"}
    args = triton["args"][:triton["args"].index("--")]
    assert launcher.parse_args(args).served_model_name == ["llama-3.1-8b", "llama"]
    assert launcher.parse_args(args).tool_call_parser == "llama3_json"
    assert launcher.parse_args(args).reasoning_parser == "qwen3"
    assert launcher.parse_args(args).responses_store_mb == 64
    default = deployment(render_chart({}))["spec"]["template"]["spec"]["containers"][0]["args"]
    assert launcher.parse_args(default[:default.index("--")]).responses_store_mb == RESPONSES_STORE_MB
    schema = json.loads((REPO_ROOT / "helm" / "specdec-triton" / "values.schema.json").read_text())
    assert schema["properties"]["openai"]["properties"]["toolCallParser"]["enum"] == ["", *launcher.TOOL_CALL_PARSERS]
    assert schema["properties"]["openai"]["properties"]["reasoningParser"]["enum"] == ["", *launcher.REASONING_PARSERS]
    assert schema["properties"]["models"]["properties"]["chatTemplateContentFormat"]["enum"] == list(launcher.CONTENT_FORMATS)
    (service,) = by_kind(docs, "Service")
    assert {"name": "openai", "port": 9000, "targetPort": "openai", "protocol": "TCP"} in service["spec"]["ports"]
    (ingress,) = by_kind(docs, "Ingress")
    paths = {p["path"]: p["backend"]["service"]["port"]["name"] for p in ingress["spec"]["rules"][0]["http"]["paths"]}
    assert paths == {"/v1": "openai", "/": "http"}
    assert launcher.parse_args(default[:default.index("--")]).responses_store_dir is None
    shared = deployment(render_chart({"openai": {"responsesStoreClaim": "responses"}}))["spec"]["template"]["spec"]
    triton = shared["containers"][0]
    store_dir = launcher.parse_args(triton["args"][:triton["args"].index("--")]).responses_store_dir
    (mount,) = [m for m in triton["volumeMounts"] if m["name"] == "responses-store"]
    (volume,) = [v for v in shared["volumes"] if v["name"] == "responses-store"]
    assert mount["mountPath"] == store_dir and not mount.get("readOnly")
    assert volume["persistentVolumeClaim"] == {"claimName": "responses"}
    assert "responses-store" not in {v["name"] for v in deployment(render_chart({}))["spec"]["template"]["spec"]["volumes"]}
    off = render_chart({"openai": {"enabled": False}, "ingress": {"enabled": True}})
    triton = deployment(off)["spec"]["template"]["spec"]["containers"][0]
    assert {var["name"]: var.get("value") for var in triton["env"]}["OPENAI_PORT"] == "0"
    assert "openai" not in {port["name"] for port in triton["ports"]}
    assert "SPECDEC_API_KEY" not in {var["name"] for var in triton["env"]}


def test_profiling_gives_the_launcher_a_directory_on_an_empty_dir_of_its_size():
    """openai.profiling: the launcher's --torch-profiler-dir (the API's /start_profile, /stop_profile) on an
    emptyDir mounted writable there; off by default, and off without the API."""
    profiled = render_chart({"openai": {"profiling": {"enabled": True, "sizeLimit": "3Gi"}}})
    pod = deployment(profiled)["spec"]["template"]["spec"]
    triton = pod["containers"][0]
    directory = launcher.parse_args(triton["args"][:triton["args"].index("--")]).torch_profiler_dir
    (mount,) = [m for m in triton["volumeMounts"] if m["name"] == "profiles"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "profiles"]
    assert directory and mount["mountPath"] == directory and not mount.get("readOnly")
    assert volume == {"name": "profiles", "emptyDir": {"sizeLimit": "3Gi"}}
    for values in ({}, {"openai": {"enabled": False, "profiling": {"enabled": True}}}):
        pod = deployment(render_chart(values))["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        assert not launcher.parse_args(args[:args.index("--")]).torch_profiler_dir, values
        assert "profiles" not in {v["name"] for v in pod["volumes"]}, values


def test_the_openai_api_over_tls_reads_its_secret_and_is_scraped_over_https_and_not_routed_as_plain_http():
    from specdec.gateway import tls

    def rendered(client_certificates: str):
        docs = render_chart({"ingress": {"enabled": True}, "monitoring": {"serviceMonitor": {"enabled": True}},
                             "openai": {"tls": {"secretName": "openai-tls",
                                                "clientCertificates": client_certificates}}})
        pod = deployment(docs)["spec"]["template"]["spec"]
        triton = pod["containers"][0]
        env = {var["name"]: var.get("value") for var in triton["env"]}
        (mount,) = [m for m in triton["volumeMounts"] if m["name"] == "openai-tls"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "openai-tls"]
        assert volume["secret"] == {"secretName": "openai-tls"} and mount["readOnly"]
        files = tls.from_env(env)  # what the launcher, its checks and the API itself read
        for path in (files.certfile, files.keyfile) + ((files.ca_certs,) if files.cert_reqs else ()):
            assert path.startswith(mount["mountPath"] + "/")
        (ingress,) = by_kind(docs, "Ingress")
        assert [p["path"] for p in ingress["spec"]["rules"][0]["http"]["paths"]] == ["/"]
        endpoints = {e["port"]: e for e in by_kind(docs, "ServiceMonitor")[0]["spec"]["endpoints"]}
        return files, endpoints

    files, endpoints = rendered("none")
    assert files.enabled and files.cert_reqs == 0 and not files.ca_certs
    assert endpoints["openai"]["scheme"] == "https" and endpoints["openai"]["tlsConfig"] == {"insecureSkipVerify": True}
    files, endpoints = rendered("optional")
    assert files.cert_reqs == 1 and files.ca_certs.endswith("/ca.crt") and "openai" in endpoints
    files, endpoints = rendered("required")
    assert files.cert_reqs == 2 and "openai" not in endpoints  # Prometheus presents no client certificate
    plain = deployment(render_chart({}))["spec"]["template"]["spec"]
    assert not any(var["name"].startswith("OPENAI_SSL_") for var in plain["containers"][0]["env"])
    assert "openai-tls" not in {v["name"] for v in plain["volumes"]}


def test_lora_adapters_from_the_hub_are_fetched_by_the_init_container_and_served():
    """models.fetch.loraRepos: the init container's LORA_REPOS, and the models' lora_adapters at
    <mountPath>/lora/<name> beside models.loraAdapters' (what `specdec.serving.fetch` writes)."""
    from specdec.engine.lora_config import parse_adapters
    from specdec.serving import fetch

    docs = render_chart({"models": {"source": "initContainer",
                                    "fetch": {"loraRepos": [{"name": "sql", "repo": "org/sql-lora@v2"},
                                                             {"name": "team/chat", "repo": "org/chat"}]},
                                    "loraAdapters": [{"name": "local", "path": "/models/local"}]}})
    (init,) = deployment(docs)["spec"]["template"]["spec"]["initContainers"]
    env = {var["name"]: var.get("value") for var in init["env"]}
    repos = parse_adapters(env["LORA_REPOS"], "LORA_REPOS")
    assert repos == {"sql": "org/sql-lora@v2", "team/chat": "org/chat"}
    (configs,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-model-config")]
    for model in ("target_model", "speculative_decoding"):
        served = re.search(r'key: "lora_adapters", value: \{ string_value: "([^"]*)"',
                           configs["data"][f"{model}.config.pbtxt"]).group(1)
        assert parse_adapters(served, "lora_adapters") == {
            "local": "/models/local", **{name: f"{env['MODELS_DIR']}/{fetch.LORA}/{name}" for name in repos}}
    plain = deployment(render_chart({"models": {"source": "initContainer"}}))["spec"]["template"]["spec"]
    assert "LORA_REPOS" not in {var["name"] for var in plain["initContainers"][0]["env"]}


def test_runtime_lora_updating_links_adapters_in_a_writable_claim_the_models_read():
    """openai.allowRuntimeLoraUpdating: the launcher's flag, and models.loraClaim mounted writable where the
    models' lora_directory points (the weights' volume is read-only); loraDirectory may name a folder of it."""
    def lora_directory(docs, model: str) -> str:
        (configs,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-model-config")]
        found = re.search(r'key: "lora_directory", value: \{ string_value: "([^"]*)"',
                          configs["data"][f"{model}.config.pbtxt"])
        return found.group(1)

    docs = render_chart({"models": {"loraClaim": "adapters"}, "openai": {"allowRuntimeLoraUpdating": True}})
    spec = deployment(docs)["spec"]["template"]["spec"]
    triton = spec["containers"][0]
    assert launcher.parse_args(triton["args"][:triton["args"].index("--")]).allow_runtime_lora_updating
    (mount,) = [m for m in triton["volumeMounts"] if m["name"] == "lora"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "lora"]
    assert volume["persistentVolumeClaim"] == {"claimName": "adapters"} and not mount.get("readOnly")
    assert lora_directory(docs, "target_model") == lora_directory(docs, "speculative_decoding") == mount["mountPath"]
    inner = render_chart({"models": {"loraClaim": "adapters", "loraDirectory": mount["mountPath"] + "/team"}})
    assert lora_directory(inner, "target_model") == mount["mountPath"] + "/team"
    default = deployment(render_chart({}))["spec"]["template"]["spec"]
    assert "lora" not in {v["name"] for v in default["volumes"]}
    assert not launcher.parse_args(default["containers"][0]["args"][:default["containers"][0]["args"].index("--")]) \
        .allow_runtime_lora_updating
    assert lora_directory(render_chart({}), "target_model") == ""


@pytest.mark.parametrize("given, param, flag", [("auto", "/models/target", "auto"), ("vllm", "/models/target", "vllm"),
                                                ("/models/gen", "/models/gen", "auto")])
def test_the_models_generation_config_reaches_the_orchestrator_and_the_launcher_as_the_launcher_renders_it(
        given, param, flag, tmp_path):
    """models.generationConfig (vLLM's --generation-config): the orchestrator reads the file it names for its end
    tokens (the target's unless a directory is given: the configs equal the launcher's); vllm reaches the
    launcher, which keeps the model's sampling defaults from the OpenAI API; openai.overrideGenerationConfig
    reaches it as JSON the launcher takes."""
    from specdec.serving.gateway_process import repository_generation_config

    override = {"temperature": 0.5, "top_k": None, "max_new_tokens": 256}
    values = {"models": {"generationConfig": given}, "openai": {"overrideGenerationConfig": override}}
    docs = render_chart(values)
    (configs,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-model-config")]
    repo = render(pair_for(chart_values(values)), tmp_path / "repo")
    text = (repo / "speculative_decoding" / "config.pbtxt").read_text()
    assert normalized(configs["data"]["speculative_decoding.config.pbtxt"]) == normalized(text)
    assert repository_generation_config(repo) == param
    triton = deployment(docs)["spec"]["template"]["spec"]["containers"][0]
    args = launcher.parse_args(triton["args"])
    assert args.generation_config == flag and json.loads(args.override_generation_config) == override
    default = deployment(render_chart({}))["spec"]["template"]["spec"]["containers"][0]["args"]
    assert (launcher.parse_args(default).generation_config, launcher.parse_args(default).override_generation_config) \
        == ("auto", "")
    with pytest.raises(helm_python.HelmError, match="invalid propertyName 'temp'"):
        render_chart({"openai": {"overrideGenerationConfig": {"temp": 0.5}}})
    schema = json.loads((CHART / "values.schema.json").read_text())
    keys = schema["properties"]["openai"]["properties"]["overrideGenerationConfig"]["propertyNames"]["enum"]
    assert keys == list(SAMPLING_KEYS)  # the keys the launcher takes


def test_a_chat_template_is_mounted_beside_preprocessings_config_as_the_launcher_writes_it(tmp_path):
    """models.chatTemplate: the ConfigMap holds it (quotes, newlines and braces intact), mounted where
    preprocessing's chat_template parameter points and the launcher finds it for the OpenAI API; the configs
    are the launcher's own for the same template."""
    from specdec.serving.gateway_process import repository_chat_template

    template = ("{%- for m in messages %}{{ '<|' + m['role'] + '|>\\n' }}{{ m[\"content\"] | trim }}\n"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}  \n")
    values = {"models": {"chatTemplate": template}}
    docs = render_chart(values)
    (configs,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-model-config")]
    assert configs["data"]["chat_template.jinja"] == template
    repo = render(pair_for(chart_values(values)), tmp_path / "repo")
    assert normalized(configs["data"]["preprocessing.config.pbtxt"]) == normalized(
        (repo / "preprocessing" / "config.pbtxt").read_text())
    triton = deployment(docs)["spec"]["template"]["spec"]["containers"][0]
    (mount,) = [m for m in triton["volumeMounts"] if m.get("subPath") == "chat_template.jinja"]
    assert mount["name"] == "model-config" and mount["readOnly"]
    # the pod's repository, as the mounts lay it out: the launcher hands the OpenAI API the same file
    pod = tmp_path / "pod"
    for m in triton["volumeMounts"]:
        if m["name"] == "model-config":
            path = pod / Path(m["mountPath"]).relative_to("/opt/specdec/model_repository")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(configs["data"][m["subPath"]])
    assert Path(repository_chat_template(pod)).read_text() == template
    plain = render_chart({})
    (configs,) = [d for d in by_kind(plain, "ConfigMap") if d["metadata"]["name"].endswith("-model-config")]
    assert "chat_template.jinja" not in configs["data"]
    assert repository_chat_template(render(pair_for(chart_values({})), tmp_path / "plain")) == ""


def test_the_executor_choices_are_the_models_own():
    """executor.kind and executor.compile offer what target_model and draft_model accept."""
    from specdec import tensor_names as tn

    schema = json.loads((REPO_ROOT / "helm" / "specdec-triton" / "values.schema.json").read_text())
    executor = schema["properties"]["executor"]["properties"]
    assert executor["kind"]["enum"] == list(tn.EXECUTORS) and executor["compile"]["enum"] == list(tn.COMPILE_MODES)


def test_the_origins_of_browser_pages_reach_the_launcher_and_the_openai_apis_process():
    """openai.allowedOrigins (vLLM's --allowed-origins; ["*"] by default, as vLLM's) and allowCredentials."""
    from specdec.gateway.__main__ import parse_args as gateway_args
    from specdec.serving.gateway_process import GatewayProcess

    default = launcher.parse_args(deployment(render_chart({}))["spec"]["template"]["spec"]["containers"][0]["args"])
    assert (json.loads(default.allowed_origins), default.allow_credentials) == (["*"], False)
    pages = ["https://chat.example.com", "https://lab.example.com"]
    args = launcher.parse_args(deployment(render_chart({"openai": {"allowedOrigins": pages, "allowCredentials": True}}))
                               ["spec"]["template"]["spec"]["containers"][0]["args"])
    assert (json.loads(args.allowed_origins), args.allow_credentials) == (pages, True)
    process = GatewayProcess(9000, 8001, ["a"], "/w/tok", 30.0, {}, cors=(args.allowed_origins, args.allowed_methods,
                                                                         args.allowed_headers, args.allow_credentials))
    api = gateway_args(process.command[3:])
    assert (json.loads(api.allowed_origins), api.allowed_methods, api.allow_credentials) == (pages, '["*"]', True)
    with pytest.raises(SystemExit):
        launcher.parse_args(["--allowed-origins", "https://chat.example.com"])  # not JSON: refused at start
