// The static Space's page: decode an image in the browser, run the model's graph on its pixels
// with ONNX Runtime Web (WebAssembly, vendored in ort/), show the ranking and, when the graph
// gives maps, the app's overlay of where the model looked. pipeline_explain.onnx's map is the one
// the Gradio page opens with for this model (integrated gradients + gradient rollout for the
// bundled model: the gradients are inside the graph), its method named in the graph's metadata;
// its rollout output is the quick choice, drawn from the same answer. pipeline_map.onnx (a model
// exported before) gives rollout alone. The graph does all of the model's preprocessing itself
// (vit_hub's docs/export.md, "From another language").
import * as ort from "./ort/ort.wasm.bundle.min.mjs";
import { mapMethod, ROLLOUT } from "./graph_method.mjs";
import { displaySize, forDisplay, overlay } from "./overlay.mjs";

const TOP_K = 5;
const MAX_PIXELS = 16_000_000; // what pipeline.onnx accepts (vit_hub.processing.preprocess.UPLOAD_MAX_PIXELS)
const threads = self.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency || 1) : 1;
// The WebAssembly binary beside the bundle (whose JavaScript glue is inside it): nothing from a CDN.
ort.env.wasm.wasmPaths = { wasm: new URL("./ort/ort-wasm-simd-threaded.wasm", import.meta.url).href };
ort.env.wasm.numThreads = threads;

const $ = (id) => document.getElementById(id);
const model = await (await fetch("model/model.json")).json();
const graph = new Uint8Array(await (await fetch(`model/${model.graph}`)).arrayBuffer());
const session = await ort.InferenceSession.create(graph, { executionProviders: ["wasm"] });
const hasMap = session.outputNames.includes("map");
// The maps the page offers: {output name: {method, label}}, the one it opens with first.
const maps = { map: mapMethod(graph), ...(session.outputNames.includes("rollout") ? { rollout: ROLLOUT } : {}) };
let last = null; // the latest answer drawn, so that another map choice redraws it without a run

function say(text, failed = false) {
  $("status").textContent = text;
  $("status").className = failed ? "error" : "";
}

// An image, a bitmap or a canvas -> uint8 RGBA pixels [height, width, 4], as pipeline.onnx takes them.
function pixelsOf(source, width, height) {
  if (width * height > MAX_PIXELS) {
    throw new Error(`image: expected at most ${MAX_PIXELS / 1e6} megapixels, got ${width}x${height}`);
  }
  const canvas = document.createElement("canvas");
  canvas.width = width;
  canvas.height = height;
  const context = canvas.getContext("2d", { willReadFrequently: true });
  context.drawImage(source, 0, 0);
  const { data } = context.getImageData(0, 0, width, height);
  return new ort.Tensor("uint8", new Uint8Array(data.buffer), [height, width, 4]);
}

// onnxruntime's error for a refused image quotes the graph's check (the failing node's name).
function refusal(error) {
  const quoted = /Name:'([^']+)'/.exec(error.message);
  return quoted ? quoted[1] : error.message.split("\n")[0];
}

async function classify(source, width, height) {
  try {
    const image = pixelsOf(source, width, height);
    const started = performance.now();
    const answer = await session.run({ image });
    const spent = performance.now() - started;
    last = { answer, source, image };
    if (hasMap) drawMap();
    show(Array.from(answer.probabilities.data), spent);
  } catch (error) {
    last = null; // nothing for another map choice to redraw
    $("ranking").replaceChildren();
    $("map").hidden = true;
    say(`Refused: ${refusal(error)}`, true);
  }
}

function show(probabilities, spent) {
  const ranked = probabilities.map((p, index) => [model.labels[index], p]).sort((a, b) => b[1] - a[1]);
  const rows = ranked.slice(0, Math.min(TOP_K, ranked.length)).map(([label, p]) => {
    const row = document.createElement("tr");
    row.innerHTML = `<td class="label"></td><td><div class="bar"></div></td><td class="value"></td>`;
    row.querySelector(".label").textContent = label;
    row.querySelector(".bar").style.width = `${(100 * p).toFixed(1)}%`;
    row.querySelector(".value").textContent = p.toFixed(3);
    return row;
  });
  $("ranking").replaceChildren(...rows);
  say(`Top class: ${ranked[0][0]}`);
  $("status").dataset.label = ranked[0][0];
  $("status").dataset.fresh = "true"; // for a script driving the page: a new answer is there
  $("ms").textContent = hasMap ? `The classes and the maps took ${spent.toFixed(0)} ms,` : `${spent.toFixed(0)} ms,`;
  $("ms").dataset.ms = spent.toFixed(1);
}

// What the app draws the map over, at most its display size, as uint8 pixels: the image the
// model saw for a digit model (its canonicalised digit), else the upload (a large one shrunk).
function underTheMap(answer, source, image) {
  const base = model.digit ? answer.model_input : image;
  const [height, width, channels] = base.dims;
  const [shownWidth, shownHeight] = displaySize(width, height);
  if (shownWidth >= width) return [base.data, height, width, channels];
  const canvas = Object.assign(document.createElement("canvas"), { width: shownWidth, height: shownHeight });
  const context = canvas.getContext("2d");
  context.imageSmoothingQuality = "high";
  context.drawImage(source, 0, 0, shownWidth, shownHeight);
  return [context.getImageData(0, 0, shownWidth, shownHeight).data, shownHeight, shownWidth, 4];
}

// The chosen map of the latest answer over its image in the #map canvas, its values (rows) in
// the canvas's data-values and its method's name in data-method.
function drawMap() {
  const { answer, source, image } = last;
  const output = $("map-choice").value;
  const drawn = answer[output];
  const [gridH, gridW] = drawn.dims;
  const gray = answer.model_input.dims[2] === 1;
  const shown = forDisplay(...underTheMap(answer, source, image), gray);
  const rgb = overlay(shown, drawn.data, gridH, gridW, answer.map_colours.data);
  const rgba = new ImageData(shown.width, shown.height);
  for (let p = 0; p < shown.width * shown.height; p++) {
    rgba.data.set(rgb.subarray(p * 3, p * 3 + 3), p * 4);
    rgba.data[p * 4 + 3] = 255;
  }
  const canvas = $("map");
  [canvas.width, canvas.height] = [shown.width, shown.height];
  canvas.getContext("2d").putImageData(rgba, 0, 0);
  const rows = Array.from({ length: gridH }, (_, row) => Array.from(drawn.data.slice(row * gridW, (row + 1) * gridW)));
  canvas.dataset.values = JSON.stringify(rows);
  canvas.dataset.method = maps[output].method;
  canvas.title = `Where the model looked: ${maps[output].label.toLowerCase()} over the image the model saw`;
  canvas.hidden = false;
}

// The map choice: the opening map first, rollout (when the graph gives it) the quick one.
function setUpMapChoice() {
  const choice = $("map-choice");
  choice.replaceChildren(...Object.entries(maps).map(([output, { method, label }]) =>
    Object.assign(document.createElement("option"), { value: output, textContent: label, title: method })));
  choice.addEventListener("change", () => { if (last && hasMap) drawMap(); });
  $("map-chooser").hidden = !hasMap || Object.keys(maps).length < 2; // a choice of one is none
}

async function classifyFile(file) {
  const url = URL.createObjectURL(file);
  $("preview").src = url;
  $("preview").hidden = false;
  await $("preview").decode().catch(() => {});
  if (!$("preview").naturalWidth) {
    say(`Refused: ${file.name} is not an image this browser can decode`, true);
    return;
  }
  await classify($("preview"), $("preview").naturalWidth, $("preview").naturalHeight);
}

function setUpDropping() {
  $("file").addEventListener("change", () => $("file").files[0] && classifyFile($("file").files[0]));
  const drop = $("drop");
  drop.addEventListener("dragover", (event) => { event.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (event) => {
    event.preventDefault();
    drop.classList.remove("over");
    if (event.dataTransfer.files[0]) classifyFile(event.dataTransfer.files[0]);
  });
}

function setUpSamples() {
  for (const name of model.samples) {
    const image = document.createElement("img");
    image.src = `samples/${name}`;
    image.alt = image.title = name;
    image.addEventListener("click", async () => {
      $("preview").src = image.src;
      $("preview").hidden = false;
      await classify(image, image.naturalWidth, image.naturalHeight);
    });
    $("samples").append(image);
  }
}

function setUpDrawing() {
  const pad = $("pad");
  const context = pad.getContext("2d");
  const clear = () => { context.fillStyle = "#fff"; context.fillRect(0, 0, pad.width, pad.height); };
  clear();
  context.lineWidth = 18;
  context.lineCap = context.lineJoin = "round";
  let drawing = false;
  pad.addEventListener("pointerdown", (event) => {
    drawing = true;
    context.beginPath();
    context.moveTo(event.offsetX, event.offsetY);
  });
  pad.addEventListener("pointermove", (event) => {
    if (!drawing) return;
    context.lineTo(event.offsetX, event.offsetY);
    context.stroke();
  });
  addEventListener("pointerup", () => { drawing = false; });
  $("clear").addEventListener("click", clear);
  $("classify-drawing").addEventListener("click", () => classify(pad, pad.width, pad.height));
  $("drawing").hidden = false;
}

document.title = $("title").textContent = model.title;
const opening = maps.map.label.toLowerCase();
const quick = maps.rollout ? ", the map the full demo opens with; attention rollout is the quick choice" : "";
const where = hasMap ? `The map shows where the model looked (${opening}${quick}). Other maps` : "Maps of where the model looked";
if (model.demo_url) {
  const link = Object.assign(document.createElement("a"), { href: model.demo_url, textContent: "full demo" });
  $("maps").append(`${where} are in the `, link, ".");
} else {
  $("maps").textContent = `${where} are in the full Gradio demo (vit-hub space without --static).`;
}
$("backend").textContent = `WebAssembly, ${threads} thread${threads > 1 ? "s" : ""}`;
setUpMapChoice();
setUpDropping();
setUpSamples();
if (model.digit) setUpDrawing();
say("Ready: drop an image or pick a sample.");
document.body.dataset.ready = "true";
