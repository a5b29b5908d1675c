# imagegen build file. Every target installs what it needs into $(VENV) first.
#   make main     the main job (see README)
#   make test     everything CI checks: notebooks clean + in sync, imports, pytest, nbdev_test
#   make nbtest   the notebooks alone (NB_FLAGS="slow cuda" adds the flagged cells; NB_FLAGS=main, after the main jobs, the
#                 cells that picture their models at the end of every model chapter)
#   make export   notebooks -> imagegen/ + scripts/ (nbdev_clean, nbdev_export, script export, stale removal)
#   make gpu-check on a GPU node: the #| cuda cells and the GPU benchmarks (GLM-Image's steps at the release's size, sharding)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
PIP := $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt
# no GPU here: run accelerate's multi-process launches as CPU (gloo) ranks
ifeq ($(shell command -v nvidia-smi 2>/dev/null),)
export ACCELERATE_USE_CPU := 1
endif

.PHONY: install export check test nbtest main diagnose sysdeps gpu-check
install: $(VENV)/.installed
# the first Python 3.10+ that runs: python3, else python3.13 ... python3.10 (override: make PYTHON=/path/to/python3)
PYTHON ?= $(shell for p in python3 python3.13 python3.12 python3.11 python3.10; do \
            $$p -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null && { command -v $$p; break; }; done)
$(VENV)/.installed: pyproject.toml constraints.txt
	@test -x $(PY) || test -n "$(PYTHON)" || { echo "no Python 3.10 or later found on PATH: install one, or run make PYTHON=/path/to/python3"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	# DeepSpeed's setup imports torch: built against the torch above (no isolated build env), no ops compiled ahead
	$(PIP) setuptools wheel && DS_BUILD_OPS=0 $(PIP) --no-build-isolation deepspeed
	$(PIP) -e ".[dev]"
	touch $@

export: install
	$(BIN)/imagegen-export

check: install
	$(BIN)/imagegen-export --check

# Debian packages the real-component tests use (a single-host Slurm cluster; Chromium for the JupyterLab browser test;
# Tesseract for the OCR reward).
# Installed when missing and possible (root + apt-get); otherwise those tests say why they skip.
SYSDEPS := slurmctld slurmd slurm-client munge chromium tesseract-ocr
sysdeps:
	@missing=$$(for p in $(SYSDEPS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing $$missing"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing >/dev/null 2>&1 || \
	  { DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null 2>&1; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing >/dev/null; } || echo "could not install $$missing"; \
	else echo "not installed (needs root + apt-get): $$missing; the Slurm and browser tests will skip"; fi

# SLOW=1 also runs the pytest tests marked slow (second variants of heavy end-to-end checks: the GLIDE main job, the GPT
# editor on two ranks, ...); CI runs without it.
SLOW ?=
# pytest runs two test files at a time (pytest-xdist, --dist loadfile: a file's fixtures are built once, in one
# worker). Much of the suite waits on single-threaded work (interpreter start-up and imports of the scripts it runs),
# which a second worker overlaps (the figures: nbs/experiments/11_test_suite_timings.ipynb). TEST_WORKERS=1 runs
# one file at a time.
TEST_WORKERS ?= 2
test: check sysdeps
	$(PY) -m pytest tests -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile $(if $(SLOW),--slow)
	$(MAKE) --no-print-directory nbtest
	@untracked=$$(git ls-files --others --exclude-standard imagegen scripts nbs 2>/dev/null); \
	if [ -n "$$untracked" ]; then echo "generated or new files not added to git: $$untracked (git add them)"; exit 1; fi
	@if [ -n "$${CI:-}" ] && [ -n "$$(git status --porcelain 2>/dev/null)" ]; then \
	  echo "the tests left the tree dirty:"; git status --porcelain; exit 1; fi

# nbdev_test runs one notebook per core, in parallel. Each would also start one torch thread per core, and on
# oversubscribed cores the small models' many short parallel ops wait for each other at every barrier: one thread per
# notebook (OMP_NUM_THREADS=1) keeps every core busy with useful work. nbs/experiments/11_test_suite_timings.ipynb has the measurement.
NB_FLAGS ?=
nbtest: install
	OMP_NUM_THREADS=1 $(BIN)/nbdev_test --timing $(if $(NB_FLAGS),--flags "$(NB_FLAGS)")

# The main job: Shapes -> a first stage -> a text-to-image model -> held-out prompts -> grid + metrics JSON.
#   FAMILY=ldm (default): tiny KL VAE -> tiny latent diffusion (recipes scripts/configs/main_vae.yaml, main_ldm.yaml)
#   FAMILY=gpt:           tiny VQ-VAE -> tiny latent GPT       (recipes scripts/configs/main_vqvae.yaml, main_gpt.yaml)
#   FAMILY=glide:         tiny GLIDE base at 32 px -> tiny 32->128 upsampler (recipes scripts/configs/main_glide.yaml,
#                         main_glide_upsampler.yaml); Shapes is also rendered at 128 px for the upsampler
#   FAMILY=glm:           GLM-Image in the release's classes at 64 px: its VAE, then both stages on it (recipes
#                         scripts/configs/main_glm_vae.yaml, main_glm.yaml; N_GLM_TRAIN training scenes drawn by the Shapes
#                         generator at 64 px), scored through GlmImagePipeline on held-out prompts and on seen pairs (validation)
# On a GPU node the same command trains on every visible GPU (accelerate launch picks them up).
# TASK=edit (FAMILY=ldm, gpt or glm): the family's text-to-image model above (trained first unless MAIN already holds it;
#   its first stage, VAE or VQ-VAE, then sees two-object scenes too, see FIRST_STAGE_DATA) is fine-tuned into an
#   instruction-based editor on Shapes edits (recipe scripts/configs/main_edit_FAMILY.yaml), then held-out edits are
#   sampled and scored: edit accuracy (change made, rest unchanged), per kind, and SSIM to the target.
# LEVEL=mixed (TASK=t2i): every stage trains on one- and two-object scenes in turn (level 1, the default: one object),
#   and the text-to-image model is also scored on 200 held-out two-object prompts with a relation (SAMPLES-level2/);
#   the starting point of reward fine-tuning for relations (nbs/experiments/05_grpo_heldout_pairs.ipynb, 06_grpo_relations.ipynb)
# VAE_STEPS / LDM_STEPS (ldm), VQ_STEPS / GPT_STEPS (gpt), GLIDE_STEPS / UP_STEPS (glide) and EDIT_STEPS (TASK=edit)
# override the recipes' step counts. LEVEL=mixed trains latent diffusion 7000 steps, twice the recipe's, with mirror
# flips (--random_flip: "left" and "right" swapped in the captions with the image): at 3500 steps it does not learn the
# relation words from mixed scenes; at 7000 without flips the vertical ones every time, "left"/"right" in one of two
# runs; with every scene also seen mirrored, all of them (nbs/experiments/06_grpo_relations.ipynb, "Mirrored scenes teach left and right").
FAMILY ?= ldm
TASK ?= t2i
LEVEL ?= 1
EDIT_STEPS ?=
MAIN ?= runs/main
VAE_STEPS ?=
LDM_STEPS ?= $(if $(filter mixed,$(LEVEL)),7000)
VQ_STEPS ?=
GPT_STEPS ?=
GLIDE_STEPS ?=
UP_STEPS ?=
N_UP_TRAIN ?= 2000
N_EVAL ?= 200
N_TRAIN ?= 10000
# on CPU, one process that uses every core (accelerate launch alone would pin it to one thread)
LAUNCH := $(BIN)/accelerate launch $(if $(ACCELERATE_USE_CPU),--num_processes 1 --num_cpu_threads_per_process $(shell nproc),)
TRAIN_DATA = $(MAIN)/shapes/imagefolder/train
# TASK=edit trains its first stage (VAE or VQ-VAE) on one- and two-object scenes in turn: its editors add and remove a
# second object, which a first stage trained on the single-object folder drops (first-stage ceilings in nbs/experiments/04_editing.ipynb);
# text-to-image keeps that folder
FIRST_STAGE_DATA = $(if $(filter edit,$(TASK)),--dataset_name shapes:level=mixed,--train_data_dir $(TRAIN_DATA))
# LEVEL=mixed: latent diffusion sees every scene mirrored too (its "left"/"right": nbs/experiments/06_grpo_relations.ipynb)
LDM_LEVEL_ARGS = $(if $(filter mixed,$(LEVEL)),--random_flip true)
define TRAIN_ldm
	$(LAUNCH) scripts/train_vae.py --config scripts/configs/main_vae.yaml --output_dir $(MAIN)/vae \
	  $(FIRST_STAGE_DATA) $(if $(VAE_STEPS),--max_train_steps $(VAE_STEPS))
	$(LAUNCH) scripts/train_ldm.py --config scripts/configs/main_ldm.yaml --output_dir $(MAIN)/ldm --vae $(MAIN)/vae/model \
	  --train_data_dir $(TRAIN_DATA) $(LDM_LEVEL_ARGS) $(if $(LDM_STEPS),--max_train_steps $(LDM_STEPS))
	$(PY) scripts/sample.py --model $(MAIN)/ldm/model --shapes_split test --n $(N_EVAL) --sampler dpmpp_2m --steps 20 --guidance 4 --out $(MAIN)/samples
	$(PY) scripts/evaluate.py --samples $(MAIN)/samples
endef
# LEVEL=mixed: the codebook head also gets a free row per code (its two-object shapes and sizes: nbs/experiments/06_grpo_relations.ipynb)
GPT_LEVEL_ARGS = $(if $(filter mixed,$(LEVEL)),--head_free_rows true)
define TRAIN_gpt
	$(LAUNCH) scripts/train_vqvae.py --config scripts/configs/main_vqvae.yaml --output_dir $(MAIN)/vqvae \
	  $(FIRST_STAGE_DATA) $(if $(VQ_STEPS),--max_train_steps $(VQ_STEPS))
	$(LAUNCH) scripts/train_gpt.py --config scripts/configs/main_gpt.yaml --output_dir $(MAIN)/gpt --vqvae $(MAIN)/vqvae/model \
	  --train_data_dir $(TRAIN_DATA) $(GPT_LEVEL_ARGS) $(if $(GPT_STEPS),--max_train_steps $(GPT_STEPS))
	$(PY) scripts/sample.py --model $(MAIN)/gpt/model --shapes_split test --n $(N_EVAL) --out $(MAIN)/gpt-samples
	$(PY) scripts/evaluate.py --samples $(MAIN)/gpt-samples
endef
define TRAIN_glide
	$(PY) scripts/make_shapes.py --out $(MAIN)/shapes128 --format imagefolder --resolution 128 --n_train $(N_UP_TRAIN) --n_validation 0 --n_test 0
	$(LAUNCH) scripts/train_glide.py --stage base --config scripts/configs/main_glide.yaml --output_dir $(MAIN)/glide \
	  --train_data_dir $(TRAIN_DATA) $(if $(GLIDE_STEPS),--max_train_steps $(GLIDE_STEPS))
	$(LAUNCH) scripts/train_glide.py --stage upsample --config scripts/configs/main_glide_upsampler.yaml --output_dir $(MAIN)/glide_upsampler \
	  --train_data_dir $(MAIN)/shapes128/imagefolder/train $(if $(UP_STEPS),--max_train_steps $(UP_STEPS))
	$(PY) scripts/sample.py --model $(MAIN)/glide/model --shapes_split test --n $(N_EVAL) --sampler dpmpp_2m --steps 20 --guidance 3 \
	  --upsampler $(MAIN)/glide_upsampler/model --upsampler_sampler dpmpp_2m --upsampler_steps 8 --out $(MAIN)/glide-samples \
	  --batch_size 16 --upsampler_batch_size 4
	$(PY) scripts/evaluate.py --samples $(MAIN)/glide-samples/base
	$(PY) scripts/evaluate.py --samples $(MAIN)/glide-samples --upsampler $(MAIN)/glide_upsampler/model --upsampler_sampler dpmpp_2m --upsampler_steps 8 \
	  --upsampler_batch_size 4
endef
N_GLM_TRAIN ?= 4000
comma := ,
GLM_STEPS ?=
GLM_VAE_STEPS ?=
GLM_GUIDANCE ?= 3
define TRAIN_glm
	$(LAUNCH) scripts/train_vae.py --config scripts/configs/main_glm_vae.yaml --output_dir $(MAIN)/glm-vae \
	  --dataset_name shapes:n=$(N_GLM_TRAIN)$(if $(or $(filter edit,$(TASK)),$(filter mixed,$(LEVEL))),$(comma)level=mixed) $(if $(GLM_VAE_STEPS),--max_train_steps $(GLM_VAE_STEPS))
	$(LAUNCH) scripts/train_glm_image.py --config scripts/configs/main_glm.yaml --output_dir $(MAIN)/glm --vae $(MAIN)/glm-vae/model \
	  --dataset_name shapes:n=$(N_GLM_TRAIN)$(if $(filter mixed,$(LEVEL)),$(comma)level=mixed) $(if $(GLM_STEPS),--max_train_steps $(GLM_STEPS))
	$(PY) scripts/sample.py --model $(MAIN)/glm/model --shapes_split test --n $(N_EVAL) --guidance $(GLM_GUIDANCE) --batch_size 50 --out $(MAIN)/glm-samples
	$(PY) scripts/evaluate.py --samples $(MAIN)/glm-samples
	$(PY) scripts/sample.py --model $(MAIN)/glm/model --shapes_split validation --n $(N_EVAL) --guidance $(GLM_GUIDANCE) --batch_size 50 --out $(MAIN)/glm-samples-seen
	$(PY) scripts/evaluate.py --samples $(MAIN)/glm-samples-seen
endef
T2I_ldm := $(MAIN)/ldm/model
T2I_gpt := $(MAIN)/gpt/model
# image guidance of the held-out edit samples, per family: the best on 200 validation edits (nbs/experiments/04_editing.ipynb)
EDIT_IMAGE_GUIDANCE_ldm ?= 2
EDIT_IMAGE_GUIDANCE_gpt ?= 1.5
define EDIT
	$(LAUNCH) scripts/train_edit.py --config scripts/configs/main_edit_$(FAMILY).yaml --pretrained_model_name_or_path $(T2I_$(FAMILY)) \
	  --output_dir $(MAIN)/$(FAMILY)-edit $(if $(EDIT_STEPS),--max_train_steps $(EDIT_STEPS))
	$(PY) scripts/sample.py --model $(MAIN)/$(FAMILY)-edit/model --shapes_edit_split test --n $(N_EVAL) \
	  --image_guidance $(EDIT_IMAGE_GUIDANCE_$(FAMILY)) --out $(MAIN)/$(FAMILY)-edit-samples
	$(PY) scripts/evaluate.py --samples $(MAIN)/$(FAMILY)-edit-samples
endef
T2I_glm := $(MAIN)/glm/model
# GLM-Image edits: the text-to-image model fine-tuned image to image (both stages; the source in the generator's chat
# template and the DiT's key/value cache, as GlmImagePipeline conditions on it), then the held-out edits through the pipeline
define EDIT_glm
	$(LAUNCH) scripts/train_glm_image.py --config scripts/configs/main_edit_glm.yaml --pretrained_model_name_or_path $(T2I_glm) \
	  --output_dir $(MAIN)/glm-edit $(if $(EDIT_STEPS),--max_train_steps $(EDIT_STEPS))
	$(PY) scripts/sample.py --model $(MAIN)/glm-edit/model --shapes_edit_split test --n $(N_EVAL) --guidance $(GLM_GUIDANCE) --batch_size 50 \
	  --out $(MAIN)/glm-edit-samples
	$(PY) scripts/evaluate.py --samples $(MAIN)/glm-edit-samples
endef
T2I_glide := $(MAIN)/glide/model
# each family's make main sampling settings, for the two-object prompts of LEVEL=mixed (GLIDE: its base model)
SAMPLE_ARGS_ldm := --sampler dpmpp_2m --steps 20 --guidance 4
SAMPLE_ARGS_gpt :=
SAMPLE_ARGS_glide := --sampler dpmpp_2m --steps 20 --guidance 3
SAMPLE_ARGS_glm = --guidance $(GLM_GUIDANCE) --batch_size 50
define LEVEL2
	$(PY) scripts/sample.py --model $(T2I_$(FAMILY)) --shapes_split test --shapes_level 2 --n $(N_EVAL) $(SAMPLE_ARGS_$(FAMILY)) \
	  --out $(SAMPLES_$(FAMILY))-level2
	$(PY) scripts/evaluate.py --samples $(SAMPLES_$(FAMILY))-level2
endef
SAMPLES_ldm := $(MAIN)/samples
SAMPLES_gpt := $(MAIN)/gpt-samples
SAMPLES_glide := $(MAIN)/glide-samples
SAMPLES_glm := $(MAIN)/glm-samples
SAMPLES = $(if $(filter edit,$(TASK)),$(MAIN)/$(FAMILY)-edit-samples,$(SAMPLES_$(FAMILY)))
# TASK=edit trains the text-to-image model only when MAIN holds none (all recipe lines are expanded before the first runs)
HAVE_T2I = $(wildcard $(T2I_$(FAMILY))/model_index.json $(T2I_$(FAMILY))/imagegen_gpt.json)
main: check
	@case "$(FAMILY)" in ldm|gpt|glide|glm) ;; *) echo "FAMILY=$(FAMILY): choose ldm, gpt, glide or glm"; exit 2;; esac
	@case "$(TASK)/$(FAMILY)" in t2i/*|edit/ldm|edit/gpt|edit/glm) ;; *) echo "TASK=$(TASK) FAMILY=$(FAMILY): TASK is t2i, or edit with FAMILY=ldm, gpt or glm"; exit 2;; esac
	@case "$(TASK)/$(LEVEL)" in */1|t2i/mixed) ;; *) echo "LEVEL=$(LEVEL) TASK=$(TASK): LEVEL is 1, or mixed with TASK=t2i"; exit 2;; esac
	$(BIN)/imagegen-diagnose
	$(if $(filter glm,$(FAMILY)),,$(PY) scripts/make_shapes.py --out $(MAIN)/shapes --format imagefolder --level $(LEVEL) --n_train $(N_TRAIN) --n_validation 500 --n_test $(N_EVAL))
	$(if $(and $(filter edit,$(TASK)),$(HAVE_T2I)),@echo "TASK=edit: starting from the text-to-image model in $(T2I_$(FAMILY)) (its first stage caps add/remove edits: evaluate.py prints the ceiling)",$(TRAIN_$(FAMILY)))
	$(if $(filter edit,$(TASK)),$(if $(filter glm,$(FAMILY)),$(EDIT_glm),$(EDIT)))
	$(if $(filter mixed,$(LEVEL)),$(LEVEL2))
	@echo "grid: $(SAMPLES)/grid.png  metrics: $(SAMPLES)/metrics.json  tensorboard: $(BIN)/tensorboard --logdir $(MAIN)"
	$(if $(filter mixed,$(LEVEL)),@echo "two objects: $(SAMPLES)-level2/grid.png  metrics: $(SAMPLES)-level2/metrics.json")

# The GPU checks, on a GPU node (sbatch --gpus 1 --wrap 'make gpu-check'): the notebooks' `#| cuda` cells, GLM-Image at
# the release's size with random weights (a supervised and a GRPO step of each stage, LoRA, gradient checkpointing, bf16:
# time, peak memory, rollouts/s), and the shared loop under DDP, FSDP2 and ZeRO-2/3 on the node's GPUs (memory per rank,
# images/s), then each family's largest model on one GPU (SD 1.5's UNet, the xl latent GPT, GLIDE base: peak memory
# under each). Tables also in GPU_OUT; gpus.txt names the cards.
GPU_OUT ?= runs/gpu-check
CUDA_NBS = $(shell grep -l '^    "\#| cuda' nbs/*.ipynb nbs/scripts/*.ipynb 2>/dev/null)
gpu-check: install
	@command -v nvidia-smi >/dev/null || { echo "make gpu-check: no nvidia-smi on this machine: run it on a GPU node (sbatch --gpus 1 --wrap 'make gpu-check')"; exit 2; }
	mkdir -p $(GPU_OUT) && nvidia-smi -L | tee $(GPU_OUT)/gpus.txt
	for nb in $(CUDA_NBS); do OMP_NUM_THREADS=1 $(BIN)/nbdev_test --flags cuda --path $$nb || exit 1; done
	set -o pipefail; $(PY) scripts/bench_glm_step.py --kinds sft,grpo | tee $(GPU_OUT)/glm_step.md
	set -o pipefail; $(PY) scripts/bench_scaling.py --num_processes $$(nvidia-smi -L | wc -l) --sharding ddp,fsdp2,zero2,zero3 \
	  --mixed_precision bf16 | tee $(GPU_OUT)/scaling.md
	set -o pipefail; for m in sd15 gpt_xl glide_base; do $(PY) scripts/bench_scaling.py --num_processes 1 --model $$m --resolution 64 \
	  --batch_size 8 --steps 10 --sharding ddp,fsdp2,zero2,zero3 --mixed_precision bf16 | tee $(GPU_OUT)/scaling_$$m.md || exit 1; done

# the distributed check alone (2 CPU ranks here, every GPU on a GPU node)
diagnose: install
	$(BIN)/imagegen-diagnose
	$(BIN)/accelerate launch $(if $(ACCELERATE_USE_CPU),--multi_gpu --num_processes 2,) scripts/diagnose_distributed.py
