"""Run a repository script with instrumentation: `python tests/dist_probe.py OUT SCRIPT [ARGS...]`, also as the target of
`accelerate launch`. The script runs unchanged (as `__main__`); each process writes OUT/rank<RANK>.pt with:
- `writes`: every file it opened for writing, renamed or removed (paths outside OUT);
- from the shared training loop, if the script trains: the batches it saw (`epoch`, `step`, sample `key`s, captions),
  the step it started at after resuming, its trainable parameters and EMA shadow at the start and end (its own slices
  under FSDP2 and ZeRO-3; `param_numel` is the whole count), FSDP2's units (`fsdp_units`: the class of each module
  `fully_shard` wrapped, the root first), each update's logged gradient norm (`grad_norms`), the process group's time-out (`pg_timeout_s`), and, for a text
  model, the tokenizer vocabulary and text-encoder weights it trained with.
Seen: Python `open`, renames, `shutil.rmtree`, `torch.save` and safetensors `save_file`; not seen: other native writers
(tokenizers' tokenizer.json, TensorBoard event files: tests check those by name)."""
import atexit, builtins, io, os, runpy, shutil, sys
from pathlib import Path

OUT = Path(sys.argv[1]).resolve()
REC = {'writes': [], 'batches': [], 'pid': os.getpid(), 'rank': int(os.environ.get('RANK', 0)),
       'world_size': int(os.environ.get('WORLD_SIZE', 1))}


def _note(kind, path):
    try: p = Path(os.fspath(path)).resolve()
    except TypeError: return  # file descriptors, buffers
    if p == OUT or OUT in p.parents or p.parts[1:2] in (('dev',), ('proc',)): return
    REC['writes'].append((kind, str(p)))


_open = builtins.open
def _open_recorded(file, mode='r', *args, **kwargs):
    if any(c in mode for c in 'wax+'): _note('open', file)
    return _open(file, mode, *args, **kwargs)
builtins.open = io.open = _open_recorded

def _wrap(mod, name, kind):
    f = getattr(mod, name)
    def g(src, *args, **kwargs):
        _note(kind, args[0] if kind != 'rmtree' and args else src)
        return f(src, *args, **kwargs)
    setattr(mod, name, g)
_wrap(os, 'rename', 'rename'); _wrap(os, 'replace', 'rename'); _wrap(shutil, 'rmtree', 'rmtree')

import torch, safetensors.torch   # patched before accelerate/diffusers import them: their files are written in C++/Rust
for _mod, _name in ((torch, 'save'), (safetensors.torch, 'save_file')):
    def _saver(f=getattr(_mod, _name)):
        def save(obj, path, *args, **kwargs):
            _note(f.__name__, path)
            return f(obj, path, *args, **kwargs)
        return save
    setattr(_mod, _name, _saver())


def _flat(params):
    "The parameters as one vector: this rank's slices under FSDP2 (DTensors) and DeepSpeed ZeRO-3 (`ds_tensor`), the whole tensors otherwise."
    import torch
    from imagegen.training.checkpoints import local_part
    return torch.cat([local_part(p).detach().float().flatten().cpu() for p in params])


def _instrument_training():
    import imagegen.training.loop as T
    _loss, _resume, _start_logging, _fit = T.Trainer._loss, T.Trainer._resume, T.Trainer._start_logging, T.Trainer.fit
    def loss(self, batch):
        b = batch if isinstance(batch, dict) else {}
        REC['batches'].append({'epoch': self.epoch, 'step': self.step, 'keys': list(b.get('key') or []),
                               'captions': list(b.get('caption') or [])})
        return _loss(self, batch)
    def resume(self):
        ck = _resume(self)
        REC.update(start_step=self.step, resumed_from=str(ck) if ck else None)
        return ck
    def start_logging(self, resumed=None):  # runs after resume, before the first update
        model = self.acc.unwrap_model(self.model)
        REC['params_start'] = _flat(model.parameters())
        REC['param_dtypes'] = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})   # as stored (FSDP2: the slices)
        # the frozen weights' dtypes: the task's modules and, for a pipeline task (GLM-Image), its components
        mods = [m for m in vars(self.task).values() if isinstance(m, torch.nn.Module)]
        pipe = getattr(getattr(self.task, 'glm', self.task), 'pipe', None)
        if pipe is not None: mods += [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
        REC['frozen_dtypes'] = sorted({str(p.dtype) for m in mods for p in m.parameters() if not p.requires_grad})
        first = next((m for m in model.modules() if isinstance(getattr(m, 'weight', None), torch.nn.Parameter) and m.weight.requires_grad), None)
        if first is not None:   # the dtype the first trained layer's weight has inside the forward (FSDP2's param_dtype casts it there)
            def seen(m, args):
                REC.setdefault('compute_dtype', str(m.weight.dtype)); h.remove()
            h = first.register_forward_pre_hook(seen)
        if self.ema: REC['ema_start'] = _flat(self.ema.shadow_params)
        import torch.distributed as dist                # the process group's time-out (InitProcessGroupKwargs, --ddp_timeout)
        if dist.is_initialized():
            REC['pg_timeout_s'] = dist.distributed_c10d._get_default_group()._get_backend(torch.device('cpu')).options._timeout.total_seconds()
        from torch.distributed.fsdp import FSDPModule   # FSDP2's units: each module fully_shard wrapped (its class renamed FSDP<name>)
        REC['fsdp_units'] = [type(m).__name__.removeprefix('FSDP') for m in model.modules() if isinstance(m, FSDPModule)]
        return _start_logging(self, resumed)
    def fit(self):
        try: return _fit(self)
        finally:
            REC.update(rank=self.acc.process_index, world_size=self.acc.num_processes, end_step=self.step,
                       losses=list(self.history), params=_flat(self.acc.unwrap_model(self.model).parameters()),
                       param_numel=sum(getattr(p, 'ds_numel', p.numel()) for p in self.acc.unwrap_model(self.model).parameters()))   # whole sizes
            if self.ema: REC['ema'] = _flat(self.ema.shadow_params)
            te = getattr(self.task, 'text_encoder', None)
            if te is not None: REC.update(vocab=te.tokenizer.get_vocab(), text_params=_flat(te.model.parameters()))
    _update = T.Trainer._update
    def update(self, *args, **kwargs):   # the gradient norm each update logged (clipping's norm: over every rank's slices)
        logs = _update(self, *args, **kwargs)
        REC.setdefault('grad_norms', []).append(logs['grad_norm'])
        return logs
    T.Trainer._loss, T.Trainer._resume, T.Trainer._start_logging, T.Trainer.fit, T.Trainer._update = loss, resume, start_logging, fit, update


@atexit.register
def _dump():
    import torch
    OUT.mkdir(parents=True, exist_ok=True)
    torch.save(REC, OUT/f"rank{REC['rank']}.pt")


if __name__ == '__main__':
    script, args = sys.argv[2], sys.argv[3:]
    _instrument_training()
    sys.argv = [script, *args]
    runpy.run_path(script, run_name='__main__')
