"""The page's stylesheet and script, inline (racks are often air-gapped: no CDN, no font).

The script only keeps a server-rendered page fresh: it fetches the JSON API every
``REFRESH_MS`` and rewrites the same elements the server rendered (text through
``textContent``, never markup from data). Without JavaScript the page is whole, just
not live. Its sha256 goes into the Content-Security-Policy, so no other script runs.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Final

REFRESH_MS: Final = 400

CSS: Final = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.2em;color:#1b1f24}
h1{font-size:1.3em;margin:0 0 .4em}
a{color:#0b57d0}
table{border-collapse:collapse;margin:.6em 0}
th,td{padding:2px 8px;text-align:left;border-bottom:1px solid #e3e6ea}
th{background:#f3f5f7}
.status{font-size:3em;font-weight:700;letter-spacing:.04em;display:inline-block;
 padding:.05em .4em;border-radius:.2em;color:#fff}
.st-UP{background:#1e8e3e}.st-DEGRADED{background:#e37400}.st-DOWN{background:#c5221f}
.st-UNKNOWN{background:#5f6368}
.badge{font-weight:700;padding:0 .4em;border-radius:.2em;color:#fff}
#matrix td,#matrix th{width:1.7em;height:1.7em;padding:0;text-align:center;border:1px solid #fff;
 font-family:ui-monospace,Menlo,Consolas,monospace;font-weight:700}
.cell.s-C{background:#1e8e3e;color:#fff}.cell.s-D{background:#c5221f;color:#fff}
.cell.s-N{background:#f29900;color:#000}.cell.s-I{background:#7b1fa2;color:#fff}
.cell.s-R{background:#fbbc04;color:#000}.cell.s-A{background:#1a73e8;color:#fff}
.cell.s-M{background:#a50e0e;color:#fff}.cell.s-self{background:#e8eaed;color:#5f6368}
.cell.s-unknown{background:#fff;color:#5f6368;outline:1px dashed #9aa0a6}
.cell.s-other{background:repeating-linear-gradient(45deg,#f1f3f4,#f1f3f4 3px,#dadce0 3px,
 #dadce0 6px);color:#5f6368}
.problems li{color:#a50e0e}
.muted{color:#5f6368}
.legend span{margin-right:1em}
"""

SCRIPT: Final = (
    """
(function(){
"use strict";
var root=document.body, ns=root.dataset.namespace, name=root.dataset.name;
var every=__REFRESH_MS__;
var base="/v1/ensembles/"+encodeURIComponent(ns||"")+"/"+encodeURIComponent(name||"");
var LETTER={CONNECTED:"C",DISCONNECTED:"D",NEVER_CONNECTED:"N",INVALID:"I",RECOVERING:"R",
 AUTHENTICATING:"A",MISMATCH:"M"};
function text(el,v){if(el&&el.textContent!==String(v))el.textContent=String(v);}
function age(s){if(s===null||s===undefined)return "-";s=Math.floor(s);
 if(s<60)return s+"s";if(s<3600)return Math.floor(s/60)+"m"+("0"+s%60).slice(-2)+"s";
 return Math.floor(s/3600)+"h"+("0"+Math.floor(s%3600/60)).slice(-2)+"m";}
function setStatus(el,st){text(el,st);el.className="status st-"+st;}
function listPage(){
 return fetch("/ui/ensembles.json",{cache:"no-store"}).then(function(r){return r.json();})
 .then(function(doc){doc.items.forEach(function(it){
  var row=document.getElementById("e-"+it.namespace+"/"+it.name);if(!row)return;
  text(row.querySelector(".members"),it.members+"/"+it.max_members);
  var b=row.querySelector(".domain");text(b,it.domain_status);
  b.className="domain badge st-"+it.domain_status;
  text(row.querySelector(".ready"),it.imex_ready);});});
}
function cellClass(letter){return letter==="."?"s-self":letter==="?"?"s-unknown":
 letter==="-"?"s-other":"s-"+letter;}
function ensemblePage(){
 return Promise.all([fetch(base,{cache:"no-store"}),fetch(base+"/domain",{cache:"no-store"})])
 .then(function(rs){return Promise.all(rs.map(function(r){
  if(!r.ok)throw new Error("HTTP "+r.status);return r.json();}));})
 .then(function(docs){var ens=docs[0],dom=docs[1];
  if(String(dom.generation)!==root.dataset.generation){location.reload();return;}
  setStatus(document.getElementById("status"),dom.status);
  var byIndex={};dom.members.forEach(function(m){byIndex[m.index]=m;});
  ens.members.forEach(function(m){var row=document.getElementById("m-"+m.index);if(!row)return;
   var d=byIndex[m.index]||{};
   text(row.querySelector(".phase"),m.phase||"-");
   text(row.querySelector(".ip"),m.ip||"-");
   text(row.querySelector(".node"),m.node||"-");
   text(row.querySelector(".imex"),d.imex_state||"-");
   text(row.querySelector(".clique"),d.clique||"-");
   text(row.querySelector(".age"),m.guest?age(m.guest.age_s)+(m.guest.stale?" STALE":""):"-");});
  var links={};dom.links.forEach(function(l){links[l.from+">"+l.to]=l.state;});
  var silent={};dom.silent.forEach(function(i){silent[i]=true;});
  var cells=document.querySelectorAll("#matrix td.cell");
  for(var k=0;k<cells.length;k++){var c=cells[k],f=c.dataset.from,t=c.dataset.to,l;
   if(f===t)l=".";else if(c.dataset.other==="1")l="-";
   else if(silent[f]||!byIndex[f]||!(f+">"+t in links))l="?";
   else l=LETTER[links[f+">"+t]]||"?";
   if(c.textContent!==l){c.textContent=l;c.className="cell "+cellClass(l);}
   c.title=f+" \\u2192 "+t+": "+(links[f+">"+t]||"no report");}
  var probs=ens.problems.concat(dom.problems.filter(function(p){
   return ens.problems.indexOf(p)<0;}));
  var ul=document.getElementById("problems");
  if(ul.dataset.text!==probs.join("\\n")){ul.dataset.text=probs.join("\\n");
   while(ul.firstChild)ul.removeChild(ul.firstChild);
   probs.forEach(function(p){var li=document.createElement("li");li.textContent=p;
    ul.appendChild(li);});
   text(document.getElementById("no-problems"),probs.length?"":"none");}
  text(document.getElementById("updated"),new Date().toLocaleTimeString());
  document.getElementById("live").className="";});
}
var busy=false;
function tick(){if(busy||document.hidden)return;busy=true;
 (ns?ensemblePage():listPage()).catch(function(){
  var l=document.getElementById("live");if(l)l.className="muted";})
 .then(function(){busy=false;});}
setInterval(tick,every);
})();
""".replace("__REFRESH_MS__", str(REFRESH_MS))
)

SCRIPT_HASH: Final = base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()

#: Nothing but this page's own inline style and script; fetches only to this origin.
CSP: Final = (
    "default-src 'none'; "
    f"script-src 'sha256-{SCRIPT_HASH}'; "
    "style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
