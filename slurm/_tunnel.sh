# Sourced by jupyter.sbatch and tensorboard.sbatch (not a job script): environment, a free port, a private log,
# and the SSH tunnel instructions for a web server running on the compute node.
#   ACTIVATE     command that activates the environment (default: source .venv/bin/activate when it exists)
#   LOGIN_HOST   the host you ssh into (default: the host the job was submitted from)
#   TUNNEL_USER  your user name there (default: $USER)
#   TUNNEL_NODE  the compute node's name as seen from the login host (default: this node's hostname)

activate_env() {
  if [ -n "${ACTIVATE:-}" ]; then eval "$ACTIVATE"
  elif [ -x .venv/bin/python ]; then source .venv/bin/activate
  fi
}

# A random free TCP port in 20000-60999 (random, so that two users on one node rarely race for the same one).
free_port() {
  "$(command -v python || command -v python3)" - <<'EOF'
import random, socket
for _ in range(200):
    port = random.randint(20000, 60999)
    with socket.socket() as s:
        try: s.bind(('', port))
        except OSError: continue
    print(port); break
else: raise SystemExit('no free port found in 20000-60999')
EOF
}

# Make the job's log files readable by the user alone (they are about to hold a secret) and keep new files private.
private_log() {
  # Make this job's log readable by its owner alone. The files are found through the batch script's own stdout and
  # stderr (/proc/$$/fd/1 and 2), so paths with spaces work and scontrol is not needed. Fails closed: returns 1 when a
  # log cannot be made private, and the caller must then not print secrets into it.
  umask 077
  local fd f ok=0
  for fd in 1 2; do
    f=$(readlink "/proc/$$/fd/$fd" 2>/dev/null) || { ok=1; continue; }
    [ "$f" = /dev/null ] && continue
    if [ -f "$f" ]; then chmod 600 "$f" 2>/dev/null || ok=1; [ "$(stat -c %a "$f" 2>/dev/null)" = 600 ] || ok=1
    elif [[ "$f" != pipe:* && "$f" != socket:* && ! -c "$f" ]]; then ok=1; fi   # a pipe or terminal is no file others read
  done
  return $ok
}

# print_tunnel PORT URL_PATH: the ssh command to run on your own machine, then the URL to open.
print_tunnel() {
  local port=$1 path=${2:-/} node=${TUNNEL_NODE:-$(hostname)} login=${LOGIN_HOST:-${SLURM_SUBMIT_HOST:-LOGIN_HOST}}
  cat <<EOF
================================================================================
$SLURM_JOB_NAME (job $SLURM_JOB_ID) on node $node, port $port.
On your own machine run (and keep it open):

    ssh -N -L localhost:$port:$node:$port ${TUNNEL_USER:-${USER:-$(id -un)}}@$login

then open:

    http://localhost:$port$path

Stop it with: scancel $SLURM_JOB_ID
================================================================================
EOF
}
